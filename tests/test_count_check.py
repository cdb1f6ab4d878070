"""The count check (docs/counts.md): before the first update, every rank refuses a count that is not the loss's own
denominator, naming the fix; setups whose count is right are never flagged, and train the same parameters with the
check on and off.

Every loss here is written in plain torch; the references import nothing from the package.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness
import pytest
import torch
import torch.nn.functional as F
from _harness import CLASSES, EXACT, HIDDEN, IGNORE_INDEX, MODES, Batch, TokenModule, TokenNet, fit, strategy_for
from _mesh import MeshModule
from _ranks import raises_everywhere
from torch import Tensor, nn

from token_mean import ClassWeightedCount, count_examples, count_sequences, count_shifted_labels
from token_mean._count_check import halves, labels_key
from token_mean._counts import count_valid_labels

K = 2
WEIGHT = torch.tensor([0.2, 3.0, 1.0, 0.5, 2.0, 0.05, 1.5], dtype=torch.float64)
Loss = Callable[[nn.Module, Batch], Tensor]


def logits_of(net: nn.Module, batch: Batch) -> Tensor:
    return net(batch["x"])


def ce(net: nn.Module, batch: Batch, reduction: str = "mean", **kwargs: Any) -> Tensor:
    logits = logits_of(net, batch)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction, **kwargs)


def shifted(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    """The shift a user writes in `training_step`: position t scores label t + 1."""
    logits = logits_of(net, batch)[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def z_loss(net: nn.Module, batch: Batch) -> Tensor:
    """Cross-entropy plus a z-loss, both means over the valid labels."""
    logits = logits_of(net, batch)
    valid = batch["labels"] != IGNORE_INDEX
    z = torch.logsumexp(logits, -1).square()
    return ce(net, batch) + 1e-2 * (z * valid).sum() / valid.sum().clamp(min=1)


def router(net: nn.Module, batch: Batch) -> Tensor:
    """Cross-entropy plus a term that does not depend on the labels (a router balancing loss inside `.loss`)."""
    return ce(net, batch) + 0.1 * logits_of(net, batch).mean().square()


def model_mask(net: nn.Module, batch: Batch) -> Tensor:
    """A mean over the valid labels the model itself keeps (its logits decide): not the labels' count."""
    logits = logits_of(net, batch)
    kept = (batch["labels"] != IGNORE_INDEX) & (logits[..., 0] > logits[..., 1])
    labels = batch["labels"].masked_fill(~kept, IGNORE_INDEX)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def row_mean(net: nn.Module, batch: Batch) -> Tensor:
    """A mean over the rows of each row's summed token loss (count_examples)."""
    per_token = F.cross_entropy(logits_of(net, batch).transpose(1, 2), batch["labels"], ignore_index=IGNORE_INDEX,
                                reduction="none")
    return per_token.sum(1).mean()


class DropoutNet(TokenNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.dropout(torch.tanh(self.hidden(x)), 0.3, self.training))


class BatchNormNet(TokenNet):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(HIDDEN, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.norm(self.hidden(x).transpose(1, 2)).transpose(1, 2)))


class LossModule(TokenModule):
    """`training_step` returns `loss(net, batch)`; `net` the TokenNet subclass of the case."""

    def __init__(self, data: list[list[Batch]], loss: Loss, net: type[TokenNet] = TokenNet) -> None:
        super().__init__(data)
        state = self.net.state_dict()
        self.net = net()
        self.net.load_state_dict(state, strict=False)
        self.loss = loss

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return self.loss(self.net, batch)


def data(seed: int = 5) -> list[list[Batch]]:
    """Ragged batches whose first label of a row is often valid (so a shift the count does not know matters)."""
    return _harness.ragged_batches(2, 4, seed=seed, keep=(0.9, 0.6))


def packed(seed: int = 6) -> list[list[Batch]]:
    """One packed row per micro-batch (several documents, one sequence)."""
    return [[{"x": b["x"].reshape(1, -1, b["x"].shape[-1]), "labels": b["labels"].reshape(1, -1)} for b in rank]
            for rank in data(seed)]


def with_empty_first(rank_data: list[list[Batch]]) -> list[list[Batch]]:
    return [[_harness.empty_like(rank[0]), *rank[1:]] for rank in rank_data]


def same(params: dict[str, Tensor], others: dict[str, Tensor]) -> bool:
    """Every parameter and buffer within 1e-15 relative (BatchNorm's step counter: equal)."""
    return params.keys() == others.keys() and all(
        torch.equal(value, others[key]) if not value.is_floating_point()
        else float((value - others[key]).norm()) <= 1e-15 * float(value.norm())
        for key, value in params.items()
    )


# ---------------------------------------------------------------------------------------------------------------
# never flagged: the same parameters with the check on and off
# ---------------------------------------------------------------------------------------------------------------

RIGHT: dict[str, tuple[Callable[[], list[list[Batch]]], Loss, type[TokenNet], dict[str, Any]]] = {
    "cross-entropy": (data, ce, TokenNet, {}),
    "label-smoothing": (data, lambda net, b: ce(net, b, label_smoothing=0.1), TokenNet, {}),
    "z-loss": (data, z_loss, TokenNet, {}),
    "router-loss": (data, router, TokenNet, {}),
    "dropout": (data, ce, DropoutNet, {}),
    "batchnorm": (data, ce, BatchNormNet, {}),
    "class-weighted": (data, lambda net, b: ce(net, b, weight=WEIGHT), TokenNet,
                       {"count_fn": ClassWeightedCount(WEIGHT)}),
    "shifted": (data, shifted, TokenNet, {"count_fn": count_shifted_labels}),
    "packed-shifted": (packed, shifted, TokenNet, {"count_fn": count_shifted_labels}),
    "sum": (data, lambda net, b: ce(net, b, "sum"), TokenNet, {"loss_reduction": "sum"}),
    "empty-micro-batch": (lambda: with_empty_first(data()), ce, TokenNet, {}),
    "examples": (data, row_mean, TokenNet, {"count_fn": count_examples}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(RIGHT))
def test_a_right_count_is_never_flagged(tmp_path: Path, case: str, mode: str) -> None:
    make_data, loss, net, settings = RIGHT[case]
    runs = {}
    for check in (True, False):
        module = LossModule(make_data(), loss, net)
        runs[check], _ = fit(module, strategy_for(mode, check_count=check, **settings), tmp_path / str(check),
                             accumulate_grad_batches=K)
    assert same(runs[True], runs[False]), "the check changed the training"
    assert any(not torch.equal(runs[True][k], v) for k, v in LossModule(data(), ce).net.state_dict().items()
               if k in runs[True]), "nothing trained"


# ---------------------------------------------------------------------------------------------------------------
# refused before the first update, naming the fix; the same run with the check off misses the objective written
# down, and the fix the message names reaches it
# ---------------------------------------------------------------------------------------------------------------


def shifted_sum(net: nn.Module, batch: Batch) -> Tensor:
    return shifted(net, batch, "sum")


def shifted_count(batch: Batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def weighted_sum(net: nn.Module, batch: Batch) -> Tensor:
    return ce(net, batch, "sum", weight=WEIGHT)


def weighted_count(batch: Batch) -> float:
    labels = batch["labels"][batch["labels"] != IGNORE_INDEX]
    return float(WEIGHT[labels].sum())


# case: (loss, settings, the message's fix, (reference loss sum, reference count), the fix's settings or None)
WRONG: dict[str, tuple[Loss, dict[str, Any], str, tuple[Loss, Callable[[Batch], Any]], dict[str, Any] | None]] = {
    "shift-with-the-default-count": (
        shifted, {}, "Fix: `count_fn=token_mean.count_shifted_labels` (the loss never predicts a row's first label",
        (shifted_sum, shifted_count), {"count_fn": count_shifted_labels},
    ),
    "sum-as-mean": (
        lambda net, b: ce(net, b, "sum"), {}, "Fix: `loss_reduction='sum'` (`training_step` returns a sum)",
        (lambda net, b: ce(net, b, "sum"), lambda b: int((b["labels"] != IGNORE_INDEX).sum())),
        {"loss_reduction": "sum"},
    ),
    "mean-as-sum": (
        ce, {"loss_reduction": "sum"}, "Fix: `loss_reduction='mean'` (`training_step` returns a mean over the count)",
        (lambda net, b: ce(net, b, "sum"), lambda b: int((b["labels"] != IGNORE_INDEX).sum())),
        {"loss_reduction": "mean"},
    ),
    "class-weights-with-the-default-count": (
        lambda net, b: ce(net, b, weight=WEIGHT), {}, "`count_fn=token_mean.ClassWeightedCount(w)`",
        (weighted_sum, weighted_count), {"count_fn": ClassWeightedCount(WEIGHT)},
    ),
    "a-mask-the-model-decides": (
        model_mask, {}, "`mode='deferred'` with `{'loss': ..., 'num_items': ...}`", (ce, count_valid_labels), None,
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_count_is_refused_on_every_rank_before_the_first_update(tmp_path: Path, case: str, mode: str) -> None:
    loss, settings, fix, (loss_sum, count), fixed = WRONG[case]
    module = LossModule(data(), loss)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(module, strategy_for(mode, **settings),
                                                                  tmp_path / "refused", accumulate_grad_batches=K))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: token_mean: the count check failed at the accumulation window of"
                                " optimizer step 0 (epoch 0, batches 0..1)"), errors[0]
    assert fix in errors[0], errors[0]
    assert not (tmp_path / "refused" / "params.pt").exists()
    if fixed is None:
        return
    expected, _ = _harness.reference_steps(_harness.lightning_steps(data(), K), loss_sum=loss_sum, count=count)
    unchecked, _ = fit(LossModule(data(), loss), strategy_for(mode, check_count=False, **settings), tmp_path / "off",
                       accumulate_grad_batches=K)
    assert _harness.relative_error(unchecked, expected) > 1e-6, "the wrong count trained the objective: no case"
    right, _ = fit(LossModule(data(), loss), strategy_for(mode, **fixed), tmp_path / "fixed",
                   accumulate_grad_batches=K)
    assert _harness.relative_error(right, expected) < EXACT


def masked_with_items(net: nn.Module, batch: Batch) -> dict[str, Tensor]:
    logits = logits_of(net, batch)
    kept = (batch["labels"] != IGNORE_INDEX) & (logits[..., 0] > logits[..., 1])
    labels = batch["labels"].masked_fill(~kept, IGNORE_INDEX)
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return {"loss": total / kept.sum().clamp(min=1), "num_items": kept.sum()}


@pytest.mark.distributed
def test_the_model_decided_mask_passes_in_deferred_mode_with_num_items(tmp_path: Path) -> None:
    """The fix the message names for a model-decided mask: deferred mode's count is the 'num_items' the step
    returns, and the check replays it too."""
    run = {}
    for check in (True, False):
        run[check], _ = fit(LossModule(data(), masked_with_items), strategy_for("deferred", check_count=check),
                            tmp_path / str(check), accumulate_grad_batches=K)
    assert same(run[True], run[False])


# ---------------------------------------------------------------------------------------------------------------
# the split itself
# ---------------------------------------------------------------------------------------------------------------


def test_which_counts_are_checked() -> None:
    batch = {"labels": torch.tensor([[1, 2]])}
    assert labels_key(count_valid_labels, batch) == "labels"
    assert labels_key(count_shifted_labels, {**batch, "shift_labels": batch["labels"]}) == "shift_labels"
    assert labels_key(ClassWeightedCount(WEIGHT), batch) == "labels"
    assert labels_key(count_examples, batch) == labels_key(count_sequences, batch) == ""  # rows

    def own(batch: Batch) -> Tensor:
        return (batch["targets"] != IGNORE_INDEX).sum()

    assert labels_key(own, batch) is None  # not checked: it does not say which labels it counts
    own.labels_key = "targets"  # type: ignore[attr-defined]
    assert labels_key(own, batch) == "targets"


def test_the_split_keeps_the_first_position_then_the_rest() -> None:
    labels = torch.tensor([[-100, 5, 6, -100], [3, 4, -100, 2]])
    first, rest, what = halves({"labels": labels, "x": torch.zeros(2, 4)}, "labels")  # type: ignore[misc]
    assert torch.equal(first["labels"], torch.tensor([[-100, -100, -100, -100], [3, -100, -100, -100]]))
    assert torch.equal(rest["labels"], torch.tensor([[-100, 5, 6, -100], [-100, 4, -100, 2]]))
    assert what == "the valid `labels` at position 0 of the last dimension"
    one_column = torch.tensor([[7], [8], [-100]])
    first, rest, what = halves({"labels": one_column}, "labels")  # type: ignore[misc]
    assert first["labels"].flatten().tolist() == [7, -100, -100]
    assert rest["labels"].flatten().tolist() == [-100, 8, -100]
    assert halves({"labels": torch.tensor([[-100, 9]])}, "labels") is None  # one valid label: nothing to split
    rows, others, what = halves({"labels": torch.zeros(3, 2), "x": torch.ones(3, 4)}, "")  # type: ignore[misc]
    assert rows["x"].shape == (1, 4) and others["x"].shape == (2, 4) and what == "its first row"
    assert len(WEIGHT) == CLASSES


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 and FSDP2 × TP: forwards only, matched on every rank
# ---------------------------------------------------------------------------------------------------------------


class ShiftedMeshModule(MeshModule):
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return shifted(self.net, batch)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("data_parallel", "tensor_parallel"), [(2, 1), (2, 2)], ids=["fsdp2", "fsdp2xtp"])
def test_under_model_parallelism(tmp_path: Path, mode: str, data_parallel: int, tensor_parallel: int) -> None:
    """A shift with the default count is refused on every rank; with `count_shifted_labels` the run trains the same
    parameters with the check on and off."""
    from test_model_parallel import strategy_for as mesh_strategy

    devices = data_parallel * tensor_parallel
    rank_data = data()[:data_parallel]
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        ShiftedMeshModule(rank_data), mesh_strategy(mode, data_parallel, tensor_parallel), tmp_path / "refused",
        devices, accumulate_grad_batches=K), ranks=devices)
    assert len(set(errors)) == 1, errors
    assert "Fix: `count_fn=token_mean.count_shifted_labels`" in errors[0], errors[0]
    runs = {}
    for check in (True, False):
        strategy = mesh_strategy(mode, data_parallel, tensor_parallel, count_fn=count_shifted_labels,
                                 check_count=check)
        runs[check], _ = fit(ShiftedMeshModule(rank_data), strategy, tmp_path / str(check), devices,
                             accumulate_grad_batches=K)
    assert same(runs[True], runs[False])


# ---------------------------------------------------------------------------------------------------------------
# cost: three forwards of one micro-batch per rank and one all_gather_object, at the first window only
# ---------------------------------------------------------------------------------------------------------------


class CountingModule(LossModule):
    """Counts its `training_step` calls and `all_gather_object` calls per rank; rank r writes ``calls{r}.json``."""

    def __init__(self, rank_data: list[list[Batch]], out: Path) -> None:
        super().__init__(rank_data, ce)
        self.out, self.steps, self.gathers = out, 0, 0

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def on_fit_start(self) -> None:
        import torch.distributed as dist

        original = dist.all_gather_object

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return original(*args, **kwargs)

        dist.all_gather_object = counted  # a forked worker's own module: the parent's stays as it was

    def on_fit_end(self) -> None:
        import json

        (self.out / f"calls{self.global_rank}.json").write_text(json.dumps([self.steps, self.gathers]))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_the_check_costs_three_forwards_and_one_gather_per_fit(tmp_path: Path, mode: str) -> None:
    """8 batches per rank, K = 2: 8 training steps and no gather without the check; 3 more replayed steps and one
    `all_gather_object` with it, whatever the number of windows."""
    import json

    calls = {}
    for check in (True, False):
        out = tmp_path / str(check)
        out.mkdir()
        fit(CountingModule(_harness.ragged_batches(2, 8, seed=9), out), strategy_for(mode, check_count=check), out,
            accumulate_grad_batches=K)
        calls[check] = [json.loads((out / f"calls{rank}.json").read_text()) for rank in (0, 1)]
    assert calls[False] == [[8, 0], [8, 0]]
    assert calls[True] == [[11, 1], [11, 1]]


class MetricModule(LossModule):
    """Updates a `TokenMeanLoss` in `training_step`; rank r writes its computed value (over every rank)."""

    def __init__(self, rank_data: list[list[Batch]], out: Path) -> None:
        from token_mean import TokenMeanLoss

        super().__init__(rank_data, ce)
        self.out, self.metric = out, TokenMeanLoss()

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.metric.update(loss.detach(), count_valid_labels(batch))
        return loss

    def on_train_end(self) -> None:
        (self.out / f"metric{self.global_rank}.txt").write_text(repr(float(self.metric.compute())))


@pytest.mark.distributed
def test_a_metric_updated_in_training_step_sees_each_batch_once(tmp_path: Path) -> None:
    """The replays run `training_step`, whose metric updates are undone: the same value with the check on and off."""
    values = {}
    for check in (True, False):
        out = tmp_path / str(check)
        out.mkdir()
        module = MetricModule(_harness.ragged_batches(2, 4, seed=12), out)
        fit(module, strategy_for("lookahead", check_count=check), out, accumulate_grad_batches=K)
        values[check] = [(out / f"metric{rank}.txt").read_text() for rank in (0, 1)]
    assert values[True] == values[False]
