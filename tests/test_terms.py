"""Objectives of several terms (docs/counts.md): J = Σ_t (1/N_t) Σ over term t's items of the step, N_t over every
rank and micro-batch, against a float64 plain-torch reference that imports nothing from the package, with a plain-DDP
control that misses; in the Trainer and in a Fabric loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _harness import (
    CLASSES,
    EXACT,
    IGNORE_INDEX,
    Batch,
    TokenModule,
    fit,
    lightning_steps,
    make_optimizer,
    ragged_batches,
    relative_error,
    strategy_for,
)
from _ranks import raises_everywhere
from torch import Tensor, nn

from token_mean import count_examples, count_micro_batches, count_shifted_labels, count_valid_labels

K = 2
TermLoss = Callable[[nn.Module, Batch, str], Tensor]  # (net, batch, "mean" | "sum") -> the term's loss


def with_classes(data: list[list[Batch]], seed: int = 0, empty_rank: int | None = None) -> list[list[Batch]]:
    """Each row also gets a class label (`cls`, -100 on a rank with none)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for rank, batches in enumerate(data):
        rows = []
        for batch in batches:
            labels = torch.randint(0, CLASSES, (batch["x"].shape[0],), generator=generator)
            if rank == empty_rank:
                labels = torch.full_like(labels, IGNORE_INDEX)
            rows.append({**batch, "cls": labels})
        out.append(rows)
    return out


def lm(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    logits = net(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def next_token(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    """A second head's loss over other targets (an MTP-like term): position t against label t + 1."""
    logits = net(batch["x"])[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def cls(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    """A classification head on the mean of the token logits, one label per row."""
    return F.cross_entropy(net(batch["x"]).mean(1), batch["cls"], ignore_index=IGNORE_INDEX, reduction=reduction)


def balance(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    """A term averaged over micro-batches (a router balancing loss): one value per micro-batch."""
    return net(batch["x"]).mean().square()


def count_cls(batch: Batch) -> Tensor:
    return (batch["cls"] != IGNORE_INDEX).sum()


def shifted_count(batch: Batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


CASES: dict[str, tuple[dict[str, tuple[TermLoss, Callable[[Batch], Any], Callable[[Batch], float]]], Any]] = {
    # name: ({term: (loss, the strategy's count, the reference's count)}, data)
    "lm-plus-classification": (
        {"lm": (lm, count_valid_labels, lambda b: float((b["labels"] != IGNORE_INDEX).sum())),
         "cls": (cls, count_examples, lambda b: float(len(b["cls"])))},
        lambda: with_classes(ragged_batches(2, 4, seed=71)),
    ),
    "two-token-terms": (
        {"lm": (lm, count_valid_labels, lambda b: float((b["labels"] != IGNORE_INDEX).sum())),
         "next": (next_token, count_shifted_labels, shifted_count)},
        lambda: ragged_batches(2, 4, seed=72, keep=(0.9, 0.3)),
    ),
    "per-micro-batch-term-with-fillers": (
        {"lm": (lm, count_valid_labels, lambda b: float((b["labels"] != IGNORE_INDEX).sum())),
         "balance": (balance, count_micro_batches, lambda b: 1.0)},
        lambda: [ragged_batches(2, 5, seed=73)[0], ragged_batches(2, 3, seed=74)[1]],  # 5 and 3 batches: fillers
    ),
    "a-term-empty-on-a-rank": (
        {"lm": (lm, count_valid_labels, lambda b: float((b["labels"] != IGNORE_INDEX).sum())),
         "cls": (cls, count_cls, lambda b: float((b["cls"] != IGNORE_INDEX).sum()))},
        lambda: with_classes(ragged_batches(2, 4, seed=75), empty_rank=1),
    ),
}


def reference(terms: dict[str, tuple[TermLoss, Any, Callable[[Batch], float]]], data: list[list[Batch]],
              steps: int | None = None) -> dict[str, Tensor]:
    """Per optimizer step of Lightning's windows, J = Σ_t Σ (term t's loss sums) / N_t; a term with N_t = 0 adds
    nothing."""
    from _harness import TokenNet, initial_state

    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    for step in lightning_steps(data, K)[:steps]:
        total: Tensor | None = None
        for loss, _, count in terms.values():
            items = sum(count(batch) for batch in step)
            if items == 0:
                continue
            part = sum(_summed(loss, net, batch, count) for batch in step) / items
            total = part if total is None else total + part
        if total is None:
            continue
        optimizer.zero_grad()
        total.backward()  # type: ignore[union-attr]
        optimizer.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


def _summed(loss: TermLoss, net: nn.Module, batch: Batch, count: Callable[[Batch], float]) -> Tensor:
    """A micro-batch's sum over the term's items (a per-micro-batch term: its one value)."""
    if count(batch) == 0:
        return torch.zeros((), dtype=torch.float64)
    return loss(net, batch, "sum") if loss is not balance else loss(net, batch)


class TermsModule(TokenModule):
    """`training_step` returns `{name: the term's mean loss}` (or, with `combined`, their sum as one loss)."""

    def __init__(self, data: list[list[Batch]], losses: dict[str, TermLoss], combined: bool = False) -> None:
        super().__init__(data)
        self.losses, self.combined = losses, combined

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        terms = {name: loss(self.net, batch, "mean") for name, loss in self.losses.items()}
        return sum(terms.values()) if self.combined else terms


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_several_terms_match_the_reference(tmp_path: Path, case: str) -> None:
    terms, make_data = CASES[case]
    data = make_data()
    counts = {name: count for name, (_, count, _) in terms.items()}
    losses = {name: loss for name, (loss, _, _) in terms.items()}
    params, windows = fit(TermsModule(data, losses), strategy_for("lookahead", count_fn=counts), tmp_path / "terms",
                          accumulate_grad_batches=K)
    expected = reference(terms, data)
    assert relative_error(params, expected) < EXACT, f"{relative_error(params, expected):.3e}"
    assert set(windows[0]["terms"]) == set(terms)
    # the control: the terms summed into one loss (what a user writes), under plain DDP; where the ranks' lengths
    # differ plain DDP cannot run, and the control is the strategy with one count for the sum
    uneven = len({len(rank) for rank in data}) > 1
    control = strategy_for("lookahead", check_count=False) if uneven else strategy_for("plain")
    plain, _ = fit(TermsModule(data, losses, combined=True), control, tmp_path / "plain", accumulate_grad_batches=K)
    assert relative_error(plain, expected) > 1e-6, "the control matched: the case cannot fail"


def test_deferred_mode_refuses_several_terms() -> None:
    from token_mean import TokenMeanDDPStrategy

    with pytest.raises(ValueError, match=r"`count_fn` with several terms \(\['cls', 'lm'\]\) needs `mode='lookahead'`"):
        TokenMeanDDPStrategy(mode="deferred", count_fn={"lm": count_valid_labels, "cls": count_examples})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"count_fn": {"loss": count_valid_labels}}, r"non-empty str keys other than \('loss', 'aux_loss', 'num_items'\)"),
    ({"count_fn": {}}, r"non-empty str keys"),
    ({"count_fn": {"lm": count_valid_labels}, "loss_reduction": {"cls": "mean"}},
     r"`loss_reduction` must name the same terms as `count_fn` \(\['lm'\]\), got \['cls'\]"),
    ({"count_fn": {"lm": count_valid_labels}, "loss_reduction": {"lm": "avg"}}, r"`loss_reduction` must be 'mean'"),
    ({"loss_reduction": {"lm": "mean"}}, r"`loss_reduction` is a mapping .* but `count_fn` is not"),
])
def test_bad_terms_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    from token_mean import TokenMeanDDPStrategy

    with pytest.raises(ValueError, match=match):
        TokenMeanDDPStrategy(**kwargs)


@pytest.mark.distributed
@pytest.mark.parametrize("returned", [("lm",), ("lm", "cls", "extra"), ("lm", "cls", "aux_loss")],
                         ids=["a-term-missing", "an-extra-term", "an-aux-loss-beside-terms"])
def test_terms_the_step_does_not_return_raise_on_every_rank(tmp_path: Path, returned: Sequence[str]) -> None:
    """An 'aux_loss' beside the terms would not be trained (it is a term with `count_micro_batches`): refused too."""
    data = with_classes(ragged_batches(2, 4, seed=76))
    available = {"lm": lm, "cls": cls, "extra": next_token, "aux_loss": balance}
    module = TermsModule(data, {name: available[name] for name in returned})
    strategy = strategy_for("lookahead", count_fn={"lm": count_valid_labels, "cls": count_examples})
    run = lambda: fit(module, strategy, tmp_path, accumulate_grad_batches=K)  # noqa: E731
    errors = raises_everywhere(tmp_path / "outcomes", run)
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: token_mean: ranks 0, 1: the terms `training_step` returned are"
                                " not the terms `count_fn` names"), errors[0]


# ---------------------------------------------------------------------------------------------------------------
# the monitor, the audit and the count check, per term
# ---------------------------------------------------------------------------------------------------------------

LM_AND_CLS = {"lm": count_valid_labels, "cls": count_examples}


@pytest.mark.distributed
def test_the_monitor_logs_records_and_compares_each_term(tmp_path: Path) -> None:
    """Each term's N and loss go to the loggers and the trace (`lm/global_count`, `lm/loss`, ...) and are compared
    with a reference trace: a reference whose `cls` losses differ diverges there, by that column."""
    import csv

    from token_mean import DenominatorMonitor

    terms, make_data = CASES["lm-plus-classification"]
    losses = {name: loss for name, (loss, _, _) in terms.items()}
    trace = tmp_path / "trace.csv"
    _, windows = fit(TermsModule(make_data(), losses), strategy_for("lookahead", count_fn=LM_AND_CLS),
                     tmp_path / "first", accumulate_grad_batches=K, callbacks=[DenominatorMonitor(record=trace)])
    rows = list(csv.DictReader(trace.open(newline="")))
    assert [float(row["cls/global_count"]) for row in rows] == [w["terms"]["cls"]["global_count"] for w in windows]
    assert [float(row["lm/loss"]) for row in rows] == [w["terms"]["lm"]["loss"] for w in windows]
    assert [float(row["loss"]) for row in rows] == pytest.approx(
        [w["terms"]["lm"]["loss"] + w["terms"]["cls"]["loss"] for w in windows], rel=1e-15)  # J
    fit(TermsModule(make_data(), losses), strategy_for("lookahead", count_fn=LM_AND_CLS), tmp_path / "same",
        accumulate_grad_batches=K, callbacks=[DenominatorMonitor(reference=trace, on_divergence="raise")])
    rows[1]["cls/loss"] = repr(float(rows[1]["cls/loss"]) * 1.01)
    shifted = tmp_path / "shifted.csv"
    with shifted.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        TermsModule(make_data(), losses), strategy_for("lookahead", count_fn=LM_AND_CLS), tmp_path / "diverged",
        accumulate_grad_batches=K, callbacks=[DenominatorMonitor(reference=shifted, on_divergence="raise")]))
    assert all("step 1 diverged" in error and "cls/loss is" in error for error in errors), errors


class OutputsRecorder(TermsModule):
    """Rank r writes every micro-batch's `outputs["loss"]` and the progress bar after each step."""

    def __init__(self, data: list[list[Batch]], losses: dict[str, TermLoss], out: Path) -> None:
        super().__init__(data, losses)
        self.out, self.seen, self.bars = out, [], []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(float(outputs["loss"]))
        self.bars.append(dict(self.trainer.progress_bar_metrics))

    def on_train_end(self) -> None:
        import json

        (self.out / f"outputs{self.global_rank}.json").write_text(json.dumps({"loss": self.seen, "bar": self.bars}))


@pytest.mark.distributed
def test_monitors_show_each_term_and_no_sum_of_unlike_counts(tmp_path: Path) -> None:
    """#41 item 8: tokens and examples are never added into one N. The bar shows `N_lm` and `N_cls`; the loggers get
    each term's count and per-rank figures (`lm/global_count`, `cls/imbalance`, ...), not the whole objective's;
    each term's per-rank counts add up to its N; `outputs["loss"]` is finite where a term has no items."""
    import json

    from _monitor_helpers import logged, trainer_for

    from token_mean import DenominatorMonitor

    data = with_classes(ragged_batches(2, 4, seed=71))
    data[0][0]["labels"] = torch.full_like(data[0][0]["labels"], IGNORE_INDEX)  # no `lm` item in this micro-batch
    out = tmp_path / "out"
    out.mkdir()
    trainer = trainer_for(tmp_path, strategy_for("lookahead", count_fn=LM_AND_CLS), devices=2,
                          accumulate_grad_batches=K, callbacks=[DenominatorMonitor()])
    trainer.fit(OutputsRecorder(data, {"lm": lm, "cls": cls}, out))
    steps = logged(tmp_path)
    assert len(steps) == 2
    for metrics in steps.values():
        assert "global_count" not in metrics and "imbalance" not in metrics and "rank_count_max" not in metrics
        for term in ("lm", "cls"):
            assert {f"{term}/global_count", f"{term}/rank_count_min", f"{term}/rank_count_max", f"{term}/imbalance",
                    f"{term}/naive_weight_error", f"{term}/loss"} <= set(metrics), metrics
            assert metrics[f"{term}/rank_count_mean"] * 2 == metrics[f"{term}/global_count"]
    first = steps[0]
    rows = sum(len(rank[i]["cls"]) for rank in data for i in range(K))
    assert first["cls/global_count"] == rows
    assert first["lm/global_count"] == sum(int((rank[i]["labels"] != IGNORE_INDEX).sum()) for rank in data
                                           for i in range(K))
    for rank in (0, 1):
        seen = json.loads((out / f"outputs{rank}.json").read_text())
        assert all(math.isfinite(loss) for loss in seen["loss"]), seen["loss"]
        bars = [bar for bar in seen["bar"] if "exact_loss" in bar]
        assert bars and all("N" not in bar and {"N_lm", "N_cls"} <= set(bar) for bar in bars), bars
        assert bars[0]["N_cls"] == rows


@pytest.mark.distributed
def test_the_audit_replays_the_whole_objective(tmp_path: Path) -> None:
    """g* is the gradient of J over both terms: every audit passes at rounding, and records each term's count
    check."""
    from test_audit import audited_fit

    terms, make_data = CASES["lm-plus-classification"]
    losses = {name: loss for name, (loss, _, _) in terms.items()}
    _, audits = audited_fit(TermsModule(make_data(), losses), strategy_for("lookahead", count_fn=LM_AND_CLS),
                            tmp_path, accumulate_grad_batches=K)
    assert len(audits[0]) == 2
    for audit in audits[0]:
        assert audit.passed and audit.error is not None and audit.error < 1e-12, audit
        assert audit.count_error is not None and audit.count_error < 1e-9, audit


@pytest.mark.distributed
def test_the_count_check_runs_per_term(tmp_path: Path) -> None:
    """A term whose loss shifts its labels under the default count is refused on every rank, naming the term."""
    data = with_classes(ragged_batches(2, 4, seed=77, keep=(0.9, 0.6)))
    module = TermsModule(data, {"lm": next_token, "cls": cls})
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        module, strategy_for("lookahead", count_fn=LM_AND_CLS), tmp_path, accumulate_grad_batches=K))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: token_mean: the count check failed at the accumulation window of"
                                " optimizer step 0 (epoch 0, batches 0..1), term 'lm'"), errors[0]
    assert "Fix: `count_fn['lm']=token_mean.count_shifted_labels`" in errors[0], errors[0]


# ---------------------------------------------------------------------------------------------------------------
# Fabric, FSDP2, cost
# ---------------------------------------------------------------------------------------------------------------


def _terms_loop(fabric: Any, data: list[list[Batch]]) -> dict[str, Tensor]:
    from _fabric import accumulator_loop

    terms = CASES["lm-plus-classification"][0]
    return accumulator_loop(fabric, data, K, "lookahead", count_fn=LM_AND_CLS,
                            loss_fn=lambda model, batch: {name: loss(model, batch, "mean")
                                                          for name, (loss, _, _) in terms.items()})


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_fabric_accumulator_takes_several_terms(layout: str) -> None:
    from _fabric import fabric_for, launched

    terms, make_data = CASES["lm-plus-classification"]
    data = make_data()
    params = launched(fabric_for("fsdp" if layout == "fsdp2" else "ddp"), _terms_loop, data)
    assert relative_error(params, reference(terms, data)) < EXACT


@pytest.mark.distributed
def test_several_terms_under_fsdp2(tmp_path: Path) -> None:
    from _mesh import MeshModule
    from test_model_parallel import strategy_for as mesh_strategy

    class MeshTerms(MeshModule):
        def training_step(self, batch: Batch, batch_idx: int) -> Any:
            return {"lm": lm(self.net, batch), "cls": cls(self.net, batch)}

    terms, make_data = CASES["lm-plus-classification"]
    data = make_data()
    params, _ = fit(MeshTerms(data), mesh_strategy("lookahead", 2, 1, count_fn=LM_AND_CLS), tmp_path, 2,
                    accumulate_grad_batches=K)
    assert relative_error(params, reference(terms, data)) < EXACT


@pytest.mark.distributed
def test_the_audit_of_several_terms_under_fsdp2_with_fillers(tmp_path: Path) -> None:
    """The sharded replay of several terms, on ranks of 5 and 3 batches (fillers, which add nothing but must still
    run the sharded collectives), with the step also returning its sum as "loss" (not the objective's): every audit
    passes at rounding and the run matches the reference."""
    from _mesh import MeshModule
    from test_audit import audited_fit
    from test_model_parallel import strategy_for as mesh_strategy

    class MeshTerms(MeshModule):
        def training_step(self, batch: Batch, batch_idx: int) -> Any:
            terms = {"lm": lm(self.net, batch), "cls": cls(self.net, batch)}
            return {**terms, "loss": terms["lm"] + terms["cls"]}

    terms = CASES["lm-plus-classification"][0]
    data = with_classes([ragged_batches(2, 5, seed=78)[0], ragged_batches(2, 3, seed=79)[1]])
    params, audits = audited_fit(MeshTerms(data), mesh_strategy("lookahead", 2, 1, count_fn=LM_AND_CLS), tmp_path,
                                 accumulate_grad_batches=K)
    assert relative_error(params, reference(terms, data)) < EXACT
    assert len(audits[0]) == 3, audits[0]
    for audit in audits[0]:
        assert audit.passed and audit.error is not None and audit.error < 1e-12, audit


@pytest.mark.distributed
def test_two_terms_cost_one_collective_per_window_and_no_read_inside(tmp_path: Path) -> None:
    """`tests/_cost.py`'s counter on a steady window (epoch 1, window 1) of a two-term fit: one all-reduce, and no
    host read between its first forward and its last backward besides the read-ahead counts of CPU batches."""
    import json

    from _cost import ACCUMULATE, DEVICES, EPOCHS, CostCounter, cost_data, summarize
    from _harness import train

    def two_terms(module: Any, batch: Batch, loss: Tensor) -> dict[str, Tensor]:
        return {"lm": loss, "balance": module.net(batch["x"]).mean().square()}

    def summed(module: Any, batch: Batch, loss: Tensor) -> Tensor:  # plain DDP's step: one loss
        return loss + module.net(batch["x"]).mean().square()

    strategy = strategy_for("lookahead", count_fn={"lm": count_valid_labels, "balance": count_micro_batches})
    for name, output_fn, run in (("terms", two_terms, strategy), ("plain", summed, strategy_for("plain"))):
        (tmp_path / name).mkdir()
        train(TokenModule(cost_data(), output_fn=output_fn), run, DEVICES, callbacks=[CostCounter(tmp_path / name)],
              accumulate_grad_batches=ACCUMULATE, max_epochs=EPOCHS)
    for rank in range(DEVICES):
        cost, plain = (summarize(json.loads((tmp_path / name / f"rank{rank}.json").read_text()))
                       for name in ("terms", "plain"))
        extra = cost.minus(plain)  # Lightning's own per-batch SIGTERM broadcast nets out
        assert extra.collectives_per_window == {"allreduce": 1}, extra
        assert extra.reads_in_window == extra.reads_in_window_host_count, extra


def nan_cls_on_rank_one(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    loss = cls(net, batch, reduction)
    return loss * float("nan") if int(batch["x"].sum() * 1e6) % 2 == 0 else loss


def negative_on_rank_one(batch: Batch) -> Any:
    return -1 if bool((batch["cls"] == IGNORE_INDEX).all()) else len(batch["cls"])


@pytest.mark.distributed
@pytest.mark.parametrize("problem", ["nan-term", "negative-count"])
def test_a_bad_term_raises_on_every_rank_before_the_update(tmp_path: Path, problem: str) -> None:
    data = with_classes(ragged_batches(2, 4, seed=78), empty_rank=1 if problem == "negative-count" else None)
    losses = {"lm": lm, "cls": nan_cls_on_rank_one if problem == "nan-term" else cls}
    counts = {"lm": count_valid_labels, "cls": negative_on_rank_one if problem == "negative-count" else count_examples}
    strategy = strategy_for("lookahead", count_fn=counts, check_count=False)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(TermsModule(data, losses), strategy, tmp_path,
                                                                  accumulate_grad_batches=K))
    assert len(set(errors)) == 1, errors
    what = ("the loss of a micro-batch that the count says holds valid items is NaN" if problem == "nan-term"
            else "`count_fn` returned a negative count")
    assert errors[0].startswith("DenominatorError: token_mean: ") and what in errors[0].splitlines()[0], errors[0]
    assert not (tmp_path / "params.pt").exists()


class ReportsTermCounts(TermsModule):
    """Reports each term's count as 'num_items' (a mapping); with ``wrong``, rank 1's 'cls' one too many."""

    def __init__(self, data: list[list[Batch]], wrong: bool) -> None:
        super().__init__(data, {"lm": lm, "cls": cls})
        self.wrong = wrong

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        extra = int(self.wrong and self.global_rank == 1)
        reported = {"lm": (batch["labels"] != IGNORE_INDEX).sum(), "cls": len(batch["cls"]) + extra}
        return {**super().training_step(batch, batch_idx), "num_items": reported}


@pytest.mark.distributed
def test_a_terms_num_items_that_disagrees_with_its_count_raises_on_every_rank(tmp_path: Path) -> None:
    """Control: reported right on every rank, the same run is exact."""
    data = with_classes(ragged_batches(2, 4, seed=79))
    strategy = strategy_for("lookahead", count_fn=LM_AND_CLS, check_count=False)
    params, _ = fit(ReportsTermCounts(data, wrong=False), strategy, tmp_path / "right", accumulate_grad_batches=K)
    assert relative_error(params, reference(CASES["lm-plus-classification"][0], data)) < EXACT
    strategy = strategy_for("lookahead", count_fn=LM_AND_CLS, check_count=False)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(ReportsTermCounts(data, wrong=True), strategy,
                                                                  tmp_path, accumulate_grad_batches=K))
    assert len(set(errors)) == 1, errors
    first = errors[0].splitlines()[0]
    assert first.startswith("DenominatorError: token_mean: rank 1: `count_fn(batch)` and the 'num_items'"), errors[0]
    assert not (tmp_path / "params.pt").exists()
