"""User code that Lightning runs around the strategy, changing what a window is: exact, or the same error everywhere.

Each setup is one Lightning accepts and a user writes: an ``optimizer_step`` override that skips an update, a transfer
hook that changes the labels, a parameter unfrozen after DDP wrapped the model, a rank whose epoch ends early.
Supported setups are compared with the plain-torch float64 reference (``_harness.reference_steps``) next to a plain
``DDPStrategy`` control that misses; refused ones must raise the same clear error on every rank, before any update
they would get wrong.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _harness import (
    EXACT,
    MODES,
    SHORT_TIMEOUT,
    Batch,
    TokenModule,
    fit,
    lightning_steps,
    ragged_batches,
    reference_steps,
    relative_error,
    strategy_for,
)
from _ranks import notes_of, raises_everywhere
from lightning.pytorch.callbacks import BaseFinetuning, Callback

MISSES = 1e-6  # a plain-DDP control "misses" the reference by more than this


def nonempty_data(batches: int, seed: int) -> list[list[Batch]]:
    """Ragged per-rank batches, every one with a valid target (a mean loss is never 0/0)."""
    data = ragged_batches(2, batches, seed=seed)
    for rank in data:
        for batch in rank:
            batch["labels"].view(-1)[0] = 1
    return data


# ---------------------------------------------------------------------------------------------------------------
# an optimizer_step override that skips an update: Lightning's docs ("the closure must still be called")
# ---------------------------------------------------------------------------------------------------------------

ACCUMULATE, SKIPPED = 2, 1  # 6 batches: windows [0, 1] [2, 3] [4, 5]; the middle one is not applied


class SkipsAStep(TokenModule):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx // ACCUMULATE == SKIPPED:
            optimizer_closure()  # the window trains, its gradient is dropped at the next window's first batch
        else:
            optimizer.step(closure=optimizer_closure)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_optimizer_step_override_that_skips_an_update(tmp_path: Path, mode: str) -> None:
    """The window after the skipped one is normalized by its own N, not by the skipped window's."""
    data = nonempty_data(6, seed=171)
    expected, counts = reference_steps(lightning_steps(data, ACCUMULATE), skipped={SKIPPED})
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT)
    params, windows = fit(SkipsAStep(data), strategy, tmp_path, accumulate_grad_batches=ACCUMULATE)
    error = relative_error(params, expected)
    if mode == "plain":
        assert error > MISSES, f"plain DDP matched the token mean ({error:.3e}): the test could not fail"
        return
    assert error < EXACT, f"relative parameter error {error:.3e}"
    assert [window["global_count"] for window in windows] == counts  # the skipped window ended too


# ---------------------------------------------------------------------------------------------------------------
# labels changed between the loader and training_step, in a transfer hook
# ---------------------------------------------------------------------------------------------------------------


def mask_class_zero(batch: Batch) -> Batch:
    """What a transfer hook may do: mask more targets (here every target of class 0)."""
    labels = batch["labels"]
    return {**batch, "labels": labels.masked_fill(labels == 0, -100)}


def truncate(batch: Batch) -> Batch:
    """... or cut the sequences short."""
    return {"x": batch["x"][:, :-1], "labels": batch["labels"][:, :-1]}


HOOK_EDITS = {"mask": mask_class_zero, "truncate": truncate}


class EditsInHook(TokenModule):
    def __init__(self, data: list[list[Batch]], hook: str, edit: str) -> None:
        super().__init__(data)
        self.hook, self.edit = hook, edit

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return HOOK_EDITS[self.edit](batch) if self.hook == "before" else batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return HOOK_EDITS[self.edit](batch) if self.hook == "after" else batch


def step_of_first_error(message: str) -> int:
    return int(message.split("optimizer step ", 1)[1].split(" ", 1)[0])


@pytest.mark.distributed
@pytest.mark.parametrize("edit", list(HOOK_EDITS))
@pytest.mark.parametrize("hook", ["before", "after"])
def test_labels_changed_in_a_transfer_hook_refused_in_lookahead(tmp_path: Path, hook: str, edit: str) -> None:
    """Lookahead counted the batches as the loader yielded them: every rank raises at the first window, before its
    update, naming the hooks and deferred mode."""
    data = nonempty_data(6, seed=172)
    module = EditsInHook(data, hook, edit)
    strategy = strategy_for("lookahead", timeout=SHORT_TIMEOUT)
    errors = raises_everywhere(
        tmp_path, lambda: fit(module, strategy, tmp_path / "run", accumulate_grad_batches=2)
    )
    assert len(set(errors)) == 1, errors
    message = errors[0]
    assert message.startswith("DenominatorError: ") and step_of_first_error(message) == 0, message
    assert "on_after_batch_transfer" in message and "mode='deferred'" in message, message
    assert "valid items as the loader yielded them" in message, message


@pytest.mark.distributed
@pytest.mark.parametrize("edit", list(HOOK_EDITS))
@pytest.mark.parametrize("mode", ["deferred", "plain"])
def test_labels_changed_in_a_transfer_hook_exact_in_deferred(tmp_path: Path, mode: str, edit: str) -> None:
    """Deferred counts the batch `training_step` receives: the objective is the edited batches' token mean."""
    data = nonempty_data(6, seed=172)
    edited = [[HOOK_EDITS[edit](batch) for batch in rank] for rank in data]
    expected, counts = reference_steps(lightning_steps(edited, 2))
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT)
    params, windows = fit(EditsInHook(data, "after", edit), strategy, tmp_path, accumulate_grad_batches=2)
    error = relative_error(params, expected)
    if mode == "plain":
        assert error > MISSES, f"plain DDP matched the token mean ({error:.3e}): the test could not fail"
        return
    assert error < EXACT, f"relative parameter error {error:.3e}"
    assert [window["global_count"] for window in windows] == counts


# ---------------------------------------------------------------------------------------------------------------
# a parameter unfrozen after DDP wrapped the model (BaseFinetuning; Lightning issue #20340)
# ---------------------------------------------------------------------------------------------------------------


class UnfreezeHidden(BaseFinetuning):
    """Freezes `net.hidden` in `setup` (before DDP wraps the model), unfreezes it at epoch 1."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.net.hidden)

    def finetune_function(self, pl_module: pl.LightningModule, current_epoch: int, optimizer: Any) -> None:
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net.hidden, optimizer, train_bn=True)


class EveryRanksParameters(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
        torch.save(state, self.out / f"params-rank{trainer.global_rank}.pt")


def replica_drift(out: Path) -> float:
    ranks = [torch.load(out / f"params-rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    return max(float((ranks[0][k] - ranks[1][k]).norm() / ranks[0][k].norm()) for k in ranks[0])


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_parameter_unfrozen_after_ddp_wrapped_the_model(tmp_path: Path, mode: str) -> None:
    """DDP reduces only what required a gradient when it wrapped the model: every rank raises at the first window
    of epoch 1, before the first update it would have left unsynchronized, naming the parameter and the fix."""
    data = nonempty_data(4, seed=173)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        TokenModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path, accumulate_grad_batches=2, max_epochs=2,
        callbacks=[UnfreezeHidden()],
    ))
    assert len(set(errors)) == 1, errors
    message = errors[0]
    assert message.startswith("DenominatorError: ") and "(epoch 1, batches 0..1)" in message, message
    assert "DDP never all-reduces its gradient" in message and "leaving parameters out" in message, message
    for rank, notes in enumerate(notes_of(tmp_path / "outcomes")):
        assert f"On rank {rank}: `net.hidden.weight` and 1 more required no gradient" in notes, notes


@pytest.mark.distributed
def test_parameter_unfrozen_after_ddp_wrapped_the_model_drifts_under_plain_ddp(tmp_path: Path) -> None:
    """The control: plain DDP trains the unfrozen parameters on each rank's own gradient; the replicas drift."""
    data = nonempty_data(4, seed=173)
    fit(TokenModule(data), strategy_for("plain", timeout=SHORT_TIMEOUT), tmp_path, accumulate_grad_batches=2,
        max_epochs=3, callbacks=[UnfreezeHidden(), EveryRanksParameters(tmp_path)])
    assert replica_drift(tmp_path) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# `on_train_batch_start` returns -1: Lightning ends that rank's epoch at a batch it does not train
#
# A token-mean fit trains every window on every rank together, and a window cut short on some ranks leaves the others
# waiting in its collectives. The package refuses the -1 on the rank that returns it, at once, before that rank
# leaves the epoch (a clear error instead of a hang); where every rank returns it at one batch, every rank raises
# the same error. Plain DDP goes on where every rank leaves (the partial window is dropped), and hangs until the
# timeout where one rank leaves.
# ---------------------------------------------------------------------------------------------------------------


class LeavesEarly(TokenModule):
    """Ranks `leavers` end epoch 0 at batch `at`, which they do not train."""

    def __init__(self, data: list[list[Batch]], at: int, leavers: tuple[int, ...] = (0,), **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        self.at = at
        self.leavers = leavers

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.global_rank in self.leavers and self.current_epoch == 0 and batch_idx == self.at else None


LEFT_EARLY = "`on_train_batch_start` returned -1 at batch {at} on rank {rank}, ending this rank's epoch there"


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_ends_its_epoch_early_raises_at_once(tmp_path: Path, mode: str) -> None:
    """Rank 0 returns -1 in the middle of a window: it raises there, naming the fix; rank 1, left in the window's
    collectives, fails with it (its own message is the process group's)."""
    module = LeavesEarly(nonempty_data(9, seed=174), 4, iterable=False)
    alone = timedelta(seconds=5)  # rank 1 waits this long in the collective rank 0 left (forked: no imports to cover)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        module, strategy_for(mode, timeout=alone), tmp_path, accumulate_grad_batches=3, max_epochs=2
    ))
    assert errors[0].startswith("DenominatorError: token_mean: " + LEFT_EARLY.format(at=4, rank=0)), errors[0]
    assert "Fix: end epochs early with `limit_train_batches` or `max_steps`" in errors[0], errors[0]
    assert LEFT_EARLY.format(at=4, rank=1) not in errors[1], errors[1]


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "iterable"), [("lookahead", False), ("deferred", False), ("lookahead", True),
                                               ("plain", False)])
def test_every_rank_ending_its_epoch_at_one_batch_is_refused_on_every_rank(tmp_path: Path, mode: str,
                                                                          iterable: bool) -> None:
    """Both ranks leave epoch 0 at batch 3: every rank raises the same error. Control: plain DDP goes on, dropping
    the partial window [2, 3]."""
    data = nonempty_data(6, seed=175)
    module = LeavesEarly(data, 3, leavers=(0, 1), iterable=iterable)
    run = lambda: fit(module, strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path,  # noqa: E731
                      accumulate_grad_batches=2, max_epochs=2)
    if mode == "plain":
        params, _ = run()
        steps = [[rank[i] for rank in data for i in window] for window in ([0, 1], [0, 1], [2, 3], [4, 5])]
        assert relative_error(params, reference_steps(steps)[0]) > 1e-6  # a mean of means, as always
        return
    errors = raises_everywhere(tmp_path / "outcomes", run)
    for rank, message in enumerate(errors):
        assert message.startswith(f"DenominatorError: token_mean: {LEFT_EARLY.format(at=3, rank=rank)}"), message


# ---------------------------------------------------------------------------------------------------------------
# `on_before_backward` sees the tensor the backward runs, not Lightning's loss / K
# ---------------------------------------------------------------------------------------------------------------


def returns_and_records(module: TokenModule, batch: Batch, loss: torch.Tensor) -> torch.Tensor:
    """`training_step`'s output: its loss, noted with the batch's count (a host read: fine in this test)."""
    module.__dict__.setdefault("returned", []).append((loss.item(), int((batch["labels"] != -100).sum())))
    return loss


class BackwardLosses(Callback):
    """Every rank writes, per micro-batch, the loss `training_step` returned and its count, and the loss Lightning's
    `on_before_backward` hook received (forked workers cannot return objects)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: list[float] = []

    def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.seen.append(loss.item())

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        record = {"returned": module.__dict__["returned"], "seen": self.seen}
        (self.out / f"backward{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["lookahead", "deferred", "plain"])
def test_on_before_backward_sees_the_loss_that_is_back_propagated(tmp_path: Path, mode: str) -> None:
    """A hook that reads the loss (gradient-scale checks, loss logging) gets what the backward runs: lookahead's loss
    times P·n/N (the window's N), deferred's loss times n/D (one D for a window), plain DDP's loss / K."""
    accumulate, data = 3, nonempty_data(6, seed=176)
    kwargs = {} if mode == "plain" else {"check_count": False}  # the count check's replays would add calls
    fit(TokenModule(data, output_fn=returns_and_records), strategy_for(mode, **kwargs), tmp_path,
        accumulate_grad_batches=accumulate, callbacks=[BackwardLosses(tmp_path)])
    ranks = [json.loads((tmp_path / f"backward{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert len(rank["seen"]) == len(rank["returned"]) == len(data[0])
    for start in range(0, len(data[0]), accumulate):
        window = range(start, start + accumulate)
        total = sum(rank["returned"][i][1] for rank in ranks for i in window)
        for rank in ranks:
            returned = [rank["returned"][i] for i in window]
            seen = [rank["seen"][i] for i in window]
            if mode == "lookahead":
                expected = [loss * 2 * count / total for loss, count in returned]
            elif mode == "deferred":  # D, unknown here, is the same for every micro-batch of the window
                ratio = seen[0] / (returned[0][0] * returned[0][1])
                expected = [loss * count * ratio for loss, count in returned]
            else:
                expected = [loss / accumulate for loss, _ in returned]
            assert seen == pytest.approx(expected, rel=1e-12), (mode, start)
            if mode != "plain":  # not Lightning's loss / K
                assert seen != pytest.approx([loss / accumulate for loss, _ in returned], rel=1e-6), (mode, start)
