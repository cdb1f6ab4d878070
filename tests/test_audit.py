"""The objective audit (``DenominatorMonitor(audit_every=...)``): every fault between the loss and the optimizer that
makes the update differ from the token-mean objective's gradient is flagged at the first audited window, with the
error the reference computes; no exact setup is ever flagged, and the audit changes nothing of the run.

The reference below is plain torch in float64 and imports nothing from the package: for the first window it computes
g*, the gradient of Σ loss sums / N over every micro-batch of every rank, and g_r, the gradient the faulty setup
leaves on rank r, and the error max_r ‖g_r − g*‖ / ‖g*‖.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _harness import (
    HIDDEN,
    SHORT_TIMEOUT,
    Batch,
    TokenModule,
    TokenNet,
    fit,
    initial_state,
    ragged_batches,
    sft_batches,
    strategy_for,
    token_loss,
    windows_of,
)
from _ranks import raises_everywhere
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from token_mean import Audit, AuditError, DenominatorError, DenominatorMonitor

Grads = dict[str, Tensor]
NEVER_FLAGGED = 1e-9  # a float64 exact run's audit error stays below this


# ---------------------------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------------------------


def gradient_of(objective: Callable[[torch.nn.Module], Tensor]) -> Grads:
    """∂ objective / ∂θ at the initial parameters, in float64."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    objective(net).backward()
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def count(batch: Batch) -> int:
    return int((batch["labels"] != -100).sum())


def first_window(data: list[list[Batch]], accumulate: int) -> list[list[Batch]]:
    """Each rank's micro-batches of the first window."""
    window = windows_of(max(len(rank) for rank in data), accumulate)[0]
    return [[rank[i] for i in window if i < len(rank)] for rank in data]


def token_mean_gradient(window: list[list[Batch]]) -> Grads:
    """g*: the gradient of Σ loss sums / N over every micro-batch of the window on every rank."""
    total = sum(count(b) for rank in window for b in rank)
    return gradient_of(lambda net: sum(token_loss(net, b, "sum") for rank in window for b in rank) / total)


def mean_of_means_gradient(window: list[list[Batch]], accumulate: int) -> Grads:
    """What plain DDP applies: the mean over ranks of Σ_m mean loss_m / K."""
    ranks = len(window)
    return gradient_of(lambda net: sum(token_loss(net, b) for rank in window for b in rank) / (accumulate * ranks))


def audit_error(applied: Sequence[Grads], expected: Grads) -> float:
    """max over ranks of ‖g_r − g*‖ / ‖g*‖."""
    norm = math.sqrt(sum(float(v.square().sum()) for v in expected.values()))
    return max(
        math.sqrt(sum(float((grads[k] - v).square().sum()) for k, v in expected.items())) / norm for grads in applied
    )


def scaled(grads: Grads, factor: float, only: str | None = None) -> Grads:
    return {k: v * factor if only is None or k == only else v.clone() for k, v in grads.items()}


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------


class AuditsWritten(Callback):
    """Every rank writes its monitor's audits (forked workers return nothing)."""

    def __init__(self, monitor: DenominatorMonitor, out: Path) -> None:
        self.monitor = monitor
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        audits = [audit.__dict__ for audit in self.monitor.audits]
        (self.out / f"audits{trainer.global_rank}.json").write_text(json.dumps(audits))


def audited_fit(
    module: pl.LightningModule, strategy: Any, tmp_path: Path, devices: int = 2, on_failure: str = "log",
    every: int = 1, callbacks: Sequence[Callback] = (), **trainer_kwargs: Any,
) -> tuple[dict[str, Tensor], list[list[Audit]]]:
    """A fit with the audit on: rank 0's final parameters and every rank's audits."""
    monitor = DenominatorMonitor(audit_every=every, on_audit_failure=on_failure)  # type: ignore[arg-type]
    params, _ = fit(module, strategy, tmp_path, devices, callbacks=[monitor, AuditsWritten(monitor, tmp_path),
                                                                    *callbacks], **trainer_kwargs)
    audits = [
        [Audit(**audit) for audit in json.loads((tmp_path / f"audits{rank}.json").read_text())]
        for rank in range(devices)
    ]
    assert all(audits_r == audits[0] for audits_r in audits), audits  # every rank has the same figures
    return params, audits


def nonempty(data: list[list[Batch]]) -> list[list[Batch]]:
    """Every micro-batch has a valid target (a mean loss is never 0/0)."""
    for rank in data:
        for batch in rank:
            batch["labels"].view(-1)[0] = 1
    return data


def assert_flagged(audits: list[list[Audit]], expected: float) -> None:
    first = audits[0][0]
    assert first.step == 0 and not first.passed and first.error is not None, audits[0]
    assert expected > 1e-3, expected  # the fault is visible
    assert abs(first.error / expected - 1) < 1e-6, (first.error, expected)  # an exact replay: the figure itself


# ---------------------------------------------------------------------------------------------------------------
# flagged
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_plain_ddp_on_ragged_ranks_is_flagged(tmp_path: Path) -> None:
    data = nonempty(ragged_batches(2, 6, seed=231))
    window = first_window(data, 3)
    expected = audit_error([mean_of_means_gradient(window, 3)] * 2, token_mean_gradient(window))
    _, audits = audited_fit(TokenModule(data), strategy_for("plain"), tmp_path, accumulate_grad_batches=3)
    assert_flagged(audits, expected)


@pytest.mark.distributed
def test_plain_ddp_failure_raises_on_every_rank_before_the_update(tmp_path: Path) -> None:
    data = nonempty(ragged_batches(2, 4, seed=232))
    errors = raises_everywhere(tmp_path / "outcomes", lambda: audited_fit(
        TokenModule(data), strategy_for("plain", timeout=SHORT_TIMEOUT), tmp_path, on_failure="raise",
        accumulate_grad_batches=2,
    ))
    assert len(set(errors)) == 1, errors
    message = errors[0]
    assert message.startswith("AuditError: The objective audit failed at optimizer step 0"), message
    assert "(tolerance 1.0e-10)" in message and "`DDPStrategy`, which does not normalize by N" in message, message
    assert issubclass(AuditError, DenominatorError)


class ScalesItsLoss(TokenModule):
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        (loss * 2.0).backward(*args, **kwargs)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_a_backward_override_that_scales_the_loss_is_flagged(tmp_path: Path, mode: str) -> None:
    data = ragged_batches(2, 4, seed=233)
    window = first_window(data, 2)
    expected = audit_error([scaled(token_mean_gradient(window), 2.0)] * 2, token_mean_gradient(window))
    _, audits = audited_fit(ScalesItsLoss(data), strategy_for(mode), tmp_path, accumulate_grad_batches=2)
    assert_flagged(audits, expected)


class HookOnRankZero(TokenModule):
    """Rank 0 triples its own contribution to `out.weight`'s gradient, before DDP reduces it."""

    def on_fit_start(self) -> None:
        if self.global_rank == 0:
            self.net.out.weight.register_hook(lambda grad: grad * 3.0)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_a_gradient_hook_on_one_rank_is_flagged(tmp_path: Path, mode: str) -> None:
    data = ragged_batches(2, 4, seed=234)
    window = first_window(data, 2)
    total = sum(count(b) for rank in window for b in rank)
    rank_zero = gradient_of(lambda net: sum(token_loss(net, b, "sum") for b in window[0]) / total)
    exact = token_mean_gradient(window)
    applied = {k: v + 2.0 * rank_zero[k] if k == "out.weight" else v for k, v in exact.items()}
    expected = audit_error([applied] * 2, exact)
    _, audits = audited_fit(HookOnRankZero(data), strategy_for(mode), tmp_path, accumulate_grad_batches=2)
    assert_flagged(audits, expected)


class ZeroesOnRankOne(TokenModule):
    def on_after_backward(self) -> None:
        if self.global_rank == 1:
            self.net.hidden.weight.grad.zero_()


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_on_after_backward_zeroing_a_layer_on_one_rank_is_flagged(tmp_path: Path, mode: str) -> None:
    """K = 1: the last backward's reduced gradient, zeroed on rank 1 only; the largest rank error is rank 1's."""
    data = ragged_batches(2, 3, seed=235)
    window = first_window(data, 1)
    exact = token_mean_gradient(window)
    expected = audit_error([exact, scaled(exact, 0.0, "hidden.weight")], exact)
    _, audits = audited_fit(ZeroesOnRankOne(data), strategy_for(mode), tmp_path)
    assert_flagged(audits, expected)


class UnfrozenAfterWrapping(TokenModule):
    """`net.hidden` requires no gradient when DDP wraps the model and one from the first batch on."""

    def setup(self, stage: str) -> None:
        self.net.hidden.requires_grad_(False)

    def on_train_start(self) -> None:
        self.net.hidden.requires_grad_(True)


@pytest.mark.distributed
def test_a_parameter_ddp_never_reduces_is_flagged(tmp_path: Path) -> None:
    """Uniform counts, so plain DDP's mean of means is the token mean but for `net.hidden`, whose gradient stays each
    rank's own."""
    data = sft_batches("uniform", 2, 3, seed=236)
    window = first_window(data, 1)
    exact = token_mean_gradient(window)
    applied = []
    for rank in window:
        own = gradient_of(lambda net, rank=rank: sum(token_loss(net, b) for b in rank))
        applied.append({k: own[k] if k.startswith("hidden.") else v for k, v in exact.items()})
    expected = audit_error(applied, exact)
    _, audits = audited_fit(UnfrozenAfterWrapping(data), strategy_for("plain"), tmp_path)
    assert_flagged(audits, expected)


# ---------------------------------------------------------------------------------------------------------------
# never flagged, and the trajectory unchanged
# ---------------------------------------------------------------------------------------------------------------


def assert_never_flagged(audits: list[list[Audit]], windows: int) -> None:
    assert len(audits[0]) == windows, audits[0]
    for audit in audits[0]:
        assert audit.passed and (audit.error is None or audit.error < NEVER_FLAGGED), audits[0]


def assert_unchanged(with_audit: dict[str, Tensor], without: dict[str, Tensor]) -> None:
    for name, value in without.items():
        assert float((with_audit[name] - value).abs().max()) <= 1e-15 * max(1.0, float(value.abs().max())), name


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_exact_runs_are_never_flagged_and_unchanged(tmp_path: Path, mode: str, accumulate: int) -> None:
    """Uneven ranks (rank 1 runs out: fillers), an empty micro-batch; every window audited."""
    data = ragged_batches(2, 7, seed=237)
    data[1] = data[1][:4]
    data[0][1] = {"x": data[0][1]["x"], "labels": torch.full_like(data[0][1]["labels"], -100)}
    plain, _ = fit(TokenModule(data), strategy_for(mode), tmp_path / "off", accumulate_grad_batches=accumulate)
    params, audits = audited_fit(TokenModule(data), strategy_for(mode), tmp_path / "on",
                                 accumulate_grad_batches=accumulate)
    assert_never_flagged(audits, len(windows_of(7, accumulate)))
    assert_unchanged(params, plain)

class DropoutModule(TokenModule):
    """Dropout between the layers, `self.log` of every loss: the replay must draw the same masks and log nothing."""

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        hidden = torch.nn.functional.dropout(torch.tanh(self.net.hidden(batch["x"])), p=0.3, training=True)
        logits = self.net.out(hidden)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


class MetricsAndRng(Callback):
    """Rank 0 writes what `self.log` logged at every batch and a draw of the RNG after the fit."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            after = {"logged": self.logged, "epoch": float(trainer.callback_metrics["train_loss_epoch"]),
                     "draw": float(torch.rand(()))}
            (self.out / "metrics.json").write_text(json.dumps(after))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_dropout_and_logged_metrics(tmp_path: Path, mode: str) -> None:
    """The trajectory, the logged metrics and the RNG stream after the fit are those of the run without audit."""
    data = ragged_batches(2, 6, seed=238)
    runs = {}
    for name, every in (("off", None), ("on", 1)):
        out = tmp_path / name
        out.mkdir()
        pl.seed_everything(7)
        monitor = DenominatorMonitor(audit_every=every, on_audit_failure="raise")
        params, _ = fit(DropoutModule(data), strategy_for(mode), out, accumulate_grad_batches=2,
                        callbacks=[monitor, MetricsAndRng(out), AuditsWritten(monitor, out)])
        runs[name] = params, json.loads((out / "metrics.json").read_text())
    assert_unchanged(runs["on"][0], runs["off"][0])
    assert runs["on"][1] == runs["off"][1]
    audits = [Audit(**a) for a in json.loads((tmp_path / "on" / "audits0.json").read_text())]
    assert len(audits) == 3 and all(a.passed and a.error is not None and a.error < NEVER_FLAGGED for a in audits)


class BatchNormModule(TokenModule):
    def __init__(self, data: list[list[Batch]]) -> None:
        super().__init__(data)
        self.norm = torch.nn.BatchNorm1d(HIDDEN, dtype=torch.float64)

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        hidden = self.net.hidden(batch["x"])
        hidden = self.norm(hidden.flatten(0, 1)).view_as(hidden)
        logits = self.net.out(torch.tanh(hidden))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


@pytest.mark.distributed
def test_batch_norm_statistics_are_unchanged(tmp_path: Path) -> None:
    """The final state (running statistics and `num_batches_tracked` included) is that of the run without audit."""
    data = nonempty(ragged_batches(2, 6, seed=239))
    plain, _ = fit(BatchNormModule(data), strategy_for("lookahead"), tmp_path / "off", accumulate_grad_batches=3)
    params, audits = audited_fit(BatchNormModule(data), strategy_for("lookahead"), tmp_path / "on",
                                 accumulate_grad_batches=3)
    assert "norm.running_mean" in params and "norm.num_batches_tracked" in params
    assert_never_flagged(audits, 2)
    assert_unchanged(params, plain)


Z_WEIGHT = 0.3


def with_aux(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    return {"loss": loss, "aux_loss": Z_WEIGHT * module.net(batch["x"]).logsumexp(-1).square().mean()}


@pytest.mark.distributed
@pytest.mark.parametrize(("method", "reduction", "output_fn"), [
    ("lookahead", "mean", with_aux),
    ("lookahead", "sum", None),
    ("deferred", "sum", None),
])
def test_aux_loss_and_loss_sums(tmp_path: Path, method: str, reduction: str, output_fn: Any) -> None:
    data = ragged_batches(2, 6, seed=240)
    data[1] = data[1][:5]
    strategy = {"loss_reduction": reduction}
    module = TokenModule(data, reduction=reduction, output_fn=output_fn)
    plain, _ = fit(module, strategy_for(method, **strategy), tmp_path / "off", accumulate_grad_batches=3)
    params, audits = audited_fit(TokenModule(data, reduction=reduction, output_fn=output_fn),
                                 strategy_for(method, **strategy), tmp_path / "on", accumulate_grad_batches=3)
    assert_never_flagged(audits, 2)
    assert_unchanged(params, plain)


@pytest.mark.distributed
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_gradient_clipping_runs_after_the_audit(tmp_path: Path, clip: str) -> None:
    data = ragged_batches(2, 6, seed=241)
    clipping = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": clip, "accumulate_grad_batches": 2}
    plain, _ = fit(TokenModule(data), strategy_for("deferred"), tmp_path / "off", **clipping)
    params, audits = audited_fit(TokenModule(data), strategy_for("deferred"), tmp_path / "on", **clipping)
    assert_never_flagged(audits, 3)
    assert_unchanged(params, plain)


@pytest.mark.distributed
def test_windows_without_items(tmp_path: Path) -> None:
    """N = 0 on every rank: nothing to compare (error None, passed); the other windows are audited as usual."""
    data = ragged_batches(2, 4, seed=242)
    for rank in data:
        for index in (0, 1):
            rank[index] = {"x": rank[index]["x"], "labels": torch.full_like(rank[index]["labels"], -100)}
    for mode in ("lookahead", "deferred"):
        _, audits = audited_fit(TokenModule(data), strategy_for(mode), tmp_path / mode, accumulate_grad_batches=2)
        assert audits[0][0].error is None and audits[0][0].passed, audits[0]
        assert_never_flagged(audits, 2)


def test_one_device(tmp_path: Path) -> None:
    """The monitor alone on one device: K = 3 over ragged micro-batches is a mean of means, flagged; the token-mean
    strategy on one device is not."""
    data = nonempty(ragged_batches(1, 6, seed=243))
    window = first_window(data, 3)
    expected = audit_error([mean_of_means_gradient(window, 3)], token_mean_gradient(window))
    _, audits = audited_fit(TokenModule(data), "auto", tmp_path / "auto", devices=1, accumulate_grad_batches=3)
    assert_flagged(audits, expected)
    _, audits = audited_fit(TokenModule(data), strategy_for("lookahead"), tmp_path / "tm", devices=1,
                            accumulate_grad_batches=3)
    assert_never_flagged(audits, 2)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"`audit_every` must be a positive int .* got 0"):
        DenominatorMonitor(audit_every=0)
    with pytest.raises(ValueError, match=r"`on_audit_failure` must be 'raise', 'warn' or 'log', got 'stop'"):
        DenominatorMonitor(audit_every=1, on_audit_failure="stop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`audit_tolerance` must be a number >= 0 .* got -1"):
        DenominatorMonitor(audit_every=1, audit_tolerance=-1)
    assert DenominatorMonitor().audits == []


@pytest.mark.distributed
def test_the_audit_runs_the_count_check(tmp_path: Path) -> None:
    """A float64 Llama whose loss transformers takes in float32: the audit's dtype is float32 (its tolerance 1e-4),
    and the gradient error is float32 rounding. With `count_shifted_labels` every audited window also runs the count
    check and records its mismatch. With the default count, which is not the loss's own denominator, and
    `check_count=False`, neither the strategy nor the audit checks the count: g* uses the same count, so the audit
    passes with `count_error` None (the user said the count is right; a wrong one is caught where the check runs: the
    first window, or `FabricMonitor`'s audits, `test_fabric_monitor_runs_the_count_check_at_its_audited_windows`)."""
    from test_counts import ObjectiveModule, causal_lm_batches, hf_model, with_empty_micro_batch

    from token_mean import count_shifted_labels, count_valid_labels

    data = with_empty_micro_batch(causal_lm_batches(2, 4, seed=61), rank=0, index=1)
    for name, count_fn, check in (("shifted", count_shifted_labels, True), ("default", count_valid_labels, False)):
        module = ObjectiveModule(hf_model(), data, lambda net, b: net(**b).loss, lr=0.1)
        strategy = strategy_for("lookahead", count_fn=count_fn, check_count=check)
        _, audits = audited_fit(module, strategy, tmp_path / name, accumulate_grad_batches=2)
        assert len(audits[0]) == 2, audits[0]
        for audit in audits[0]:
            assert audit.tolerance == 1e-4 and audit.error is not None and audit.error < 1e-5, audit
            assert audit.passed, audit
            if check:
                assert audit.count_error is not None and audit.count_error < 2e-5, audit
            else:
                assert audit.count_error is None, audit


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_a_resumed_run(tmp_path: Path, mode: str) -> None:
    """Resumed from the end of epoch 0, the audit starts at the resumed run's first window; the trajectory is that
    of the resumed run without audit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = ragged_batches(2, 4, seed=244)
    checkpoints = tmp_path / "checkpoints"
    fit(TokenModule(data), strategy_for(mode), tmp_path / "first", accumulate_grad_batches=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True)])
    last = checkpoints / "last.ckpt"
    resumed = {"accumulate_grad_batches": 2, "max_epochs": 2, "ckpt_path": last}
    plain, _ = fit(TokenModule(data), strategy_for(mode), tmp_path / "off", **resumed)
    params, audits = audited_fit(TokenModule(data), strategy_for(mode), tmp_path / "on", **resumed)
    assert [audit.step for audit in audits[0]] == [2, 3], audits[0]
    assert_never_flagged(audits, 2)
    assert_unchanged(params, plain)


# ---------------------------------------------------------------------------------------------------------------
# Fabric
# ---------------------------------------------------------------------------------------------------------------


def litgpt_loop_audited(fabric: Any, data: list[list[Batch]], accumulate: int,
                        count_fn: Any = None) -> list[dict[str, Any]]:
    """LitGPT's `fabric.backward(loss / K)` loop, audited by `FabricMonitor` alone (by default with the loss's own
    count, `count_shifted_labels`)."""
    from _fabric import rank_batches, setup, shifted_loss

    from token_mean import count_shifted_labels
    from token_mean.fabric_monitor import FabricMonitor

    monitor = FabricMonitor(audit_every=1, audit_loss=shifted_loss, count_fn=count_fn or count_shifted_labels,
                            on_audit_failure="log")
    model, optimizer = setup(fabric)
    audits = []
    for index, batch in enumerate(rank_batches(fabric, data)):
        accumulating = (index + 1) % accumulate != 0
        monitor.micro_batch(model, batch)
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(shifted_loss(model, batch) / accumulate)
        if not accumulating:
            audits.append(monitor.audit(model).__dict__)
            optimizer.step()
            optimizer.zero_grad()
    return audits


def litgpt_case(seed: int) -> tuple[list[list[Batch]], float]:
    """Two ranks' ragged batches with a shifted target in every row, and the audit error of LitGPT's loop (each
    micro-batch's shifted mean / K, averaged over P = 2) on their first window of K = 2: what the audit must report."""
    from _fabric import shifted_count, shifted_loss

    data = nonempty(ragged_batches(2, 4, seed=seed))
    for rank in data:
        for batch in rank:
            batch["labels"][:, 1] = 2
    window = first_window(data, 2)
    total = sum(shifted_count(b) for rank in window for b in rank)
    exact = gradient_of(lambda net: sum(shifted_loss(net, b, "sum") for rank in window for b in rank) / total)
    naive = gradient_of(lambda net: sum(shifted_loss(net, b) for rank in window for b in rank) / (2 * 2))
    return data, audit_error([naive] * 2, exact)


@pytest.mark.distributed
def test_fabric_monitor_runs_the_count_check_at_its_audited_windows() -> None:
    """The first audited window included: with the loss's own count every count error is rounding; with the
    default count (the loss shifts, the count does not) every audit fails on its count."""
    from _fabric import fabric_for, launched

    from token_mean import count_valid_labels

    data, _ = litgpt_case(seed=246)
    right = [Audit(**a) for a in launched(fabric_for("ddp"), litgpt_loop_audited, data, 2)]
    wrong = [Audit(**a) for a in launched(fabric_for("ddp"), litgpt_loop_audited, data, 2, count_valid_labels)]
    assert [a.step for a in right] == [a.step for a in wrong] == [0, 1]
    assert all(a.count_error is not None and a.count_error < 2e-5 for a in right), right
    assert all(a.count_error is not None and a.count_error > 1e-3 and not a.passed for a in wrong), wrong


@pytest.mark.distributed
def test_fabric_litgpt_loop_is_flagged_by_the_monitor_alone() -> None:
    from _fabric import fabric_for, launched

    data, expected = litgpt_case(245)
    audits = [Audit(**a) for a in launched(fabric_for("ddp"), litgpt_loop_audited, data, 2)]
    assert [a.step for a in audits] == [0, 1]
    assert_flagged([audits], expected)


def accumulator_audited(fabric: Any, data: list[list[Batch]], mode: str, every: int | None) -> dict[str, Any]:
    from _fabric import accumulator_loop, shifted_loss

    from token_mean.fabric_monitor import FabricMonitor

    windows: list[dict[str, Any]] = []
    monitor = FabricMonitor(audit_every=every, audit_loss=shifted_loss, on_audit_failure="raise")
    params = accumulator_loop(fabric, data, 3, mode, windows=windows, monitor=monitor)
    return {"params": params, "errors": [w["audit_error"] for w in windows],
            "audits": [a.__dict__ for a in monitor.audits]}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_fabric_accumulator_is_never_flagged_and_unchanged(mode: str) -> None:
    """Fabric DDP, uneven ranks (fillers), K = 3: every window audited in `finish()`, its figure on the stats."""
    from _fabric import fabric_for, launched

    data = ragged_batches(2, 7, seed=246)
    data[1] = data[1][:5]
    off = launched(fabric_for("ddp"), accumulator_audited, data, mode, None)
    on = launched(fabric_for("ddp"), accumulator_audited, data, mode, 1)
    assert off["errors"] == [None] * 3 and off["audits"] == []
    assert len(on["errors"]) == 3 and all(e is not None and e < NEVER_FLAGGED for e in on["errors"]), on["errors"]
    assert [Audit(**a).passed for a in on["audits"]] == [True] * 3
    assert_unchanged(on["params"], off["params"])


FABRIC_LOOPS = ("lookahead", "deferred", "plain")
"""The accumulator's loop in each mode (K = 3), and LitGPT's with K = 1 (each micro-batch is its own window: its mean
loss is the window's token mean, so the audit passes; the monitor alone finds the ranks that share N)."""


def loop_audits(fabric: Any, data: list[list[Batch]], loop: str) -> list[dict[str, Any]]:
    """Every window of ``loop`` (:data:`FABRIC_LOOPS`) audited: the audits."""
    if loop == "plain":
        return litgpt_loop_audited(fabric, data, 1)
    return list(accumulator_audited(fabric, data, loop, 1)["audits"])


def assert_passed(audits: list[dict[str, Any]], windows: int, rank: int) -> None:
    assert len(audits) == windows, f"rank {rank}: {audits}"
    for audit in map(lambda a: Audit(**a), audits):
        assert audit.passed and (audit.error is None or audit.error < NEVER_FLAGGED), f"rank {rank}: {audits}"


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("loop", FABRIC_LOOPS)
def test_fabric_one_device_audit_in_a_process_with_a_default_group(loop: str, tmp_path: Path) -> None:
    """Two processes with a gloo default group (launched for other reasons) each audit their own run on one device,
    on their own data and windows (7 and 5 micro-batches): every audit passes and none issues a collective. The
    default group's ranks share no denominator; an audit reducing over them compares each rank's gradient with that
    of both ranks' windows (a false failure), or waits in a window only one of them audits (the group's 15 s)."""
    from _fabric import forked_ranks, launched, ragged

    data = ragged(2, 7, seed=251)
    data[1] = data[1][:5]
    results = launched(forked_ranks(), _audited_alone, data, loop, tmp_path)
    for rank, (audits, collectives) in enumerate(results):
        assert_passed(audits, len(windows_of(len(data[rank]), 1 if loop == "plain" else 3)), rank)
        assert collectives == {}, f"rank {rank} issued collectives: {collectives}"


def _audited_alone(fabric: Any, data: list[list[Batch]], loop: str, directory: Path) -> list[Any]:
    from _cost import collectives_issued
    from _fabric import every_rank
    from lightning.fabric import Fabric

    own = [data[fabric.global_rank]]
    audits, collectives = collectives_issued(directory, loop_audits, Fabric(accelerator="cpu", devices=1), own, loop)
    return every_rank((audits, dict(collectives)))


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("group", "loop"), [*(("own", loop) for loop in FABRIC_LOOPS), ("both", "lookahead"),
                                             ("both", "deferred")])
def test_fabric_ddp_audit_over_its_process_group(group: str, loop: str) -> None:
    """Fabric's DDP over a process group of this rank alone (``_ddp_kwargs["process_group"]``): the audit adds up
    counts and gradients over DDP's group, as the update does, and passes on every rank (an audit over the default
    group compares each rank's own gradient with that of both ranks' windows). Over a group of both ranks (another
    object than the default group), the audit runs over that group."""
    from _fabric import forked_ranks, launched, ragged

    data = ragged(2, 7, seed=252)
    results = launched(forked_ranks(), _audited_in_group, data, group, loop)
    for rank, audits in enumerate(results):
        assert_passed(audits, len(windows_of(7, 1 if loop == "plain" else 3)), rank)


def _audited_in_group(fabric: Any, data: list[list[Batch]], group: str, loop: str) -> list[Any]:
    from _fabric import every_rank, subgroups

    fabric.strategy._ddp_kwargs["process_group"] = subgroups(fabric)[group]  # read as `fabric.setup` wraps the model
    return every_rank(loop_audits(fabric, data, loop))


def test_fabric_monitor_needs_the_loss() -> None:
    from token_mean.fabric_monitor import FabricMonitor

    with pytest.raises(ValueError, match=r"`audit_every=2` needs `audit_loss`, a callable fn\(model, batch\)"):
        FabricMonitor(audit_every=2)


class ManualModule(TokenModule):
    def __init__(self, data: list[list[Batch]]) -> None:
        super().__init__(data)
        self.automatic_optimization = False

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(token_loss(self.net, batch))
        optimizer.step()


def test_manual_optimization_is_refused(tmp_path: Path) -> None:
    """Replaying a `training_step` that steps the optimizer itself would train: refused before the first batch."""
    with pytest.raises(ValueError, match=r"needs automatic optimization: with `automatic_optimization = False`"):
        audited_fit(ManualModule(ragged_batches(1, 2, seed=249)), "auto", tmp_path, devices=1)


@pytest.mark.parametrize(("precision", "tolerance"), [("32-true", 1e-4), ("bf16-mixed", 5e-2)])
def test_default_tolerance_follows_the_precision(tmp_path: Path, precision: str, tolerance: float) -> None:
    """A float32 model on one device under the token-mean strategy: passes at the float32 default; under
    `bf16-mixed` (the replay runs under the same autocast) at the looser bf16 default."""
    from _harness import cast

    data = cast(ragged_batches(1, 4, seed=250), torch.float32)
    module = TokenModule(data, dtype=torch.float32)
    _, audits = audited_fit(module, strategy_for("lookahead"), tmp_path, devices=1, accumulate_grad_batches=2,
                            precision=precision)
    assert [a.tolerance for a in audits[0]] == [tolerance] * 2, audits[0]
    assert all(a.passed and a.error is not None for a in audits[0]), audits[0]
