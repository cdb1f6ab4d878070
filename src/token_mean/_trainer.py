"""What the Trainer strategies check and keep beyond the hooks: the fit's setup, the checkpoint, the closure.

Module-level so that ``TokenMeanStrategy`` stays a class of hooks that delegate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn import Module

from token_mean import _lightning
from token_mean._checkpoint import RankPosition, every_rank, this_rank
from token_mean._core import Layout
from token_mean._epoch import Epoch, Epochs

CHECKPOINT_KEY = "token_mean"


def catch_up(trainer: pl.Trainer, layout: Layout) -> Callable[[Epoch, int], None]:
    """What a rank whose epoch ended at a batch it did not train still runs of the others' window: what their next
    forward runs (the layout's), then the batch starts Lightning broadcasts until their window's exchange."""

    def run(epoch: Epoch, position: int) -> None:
        starts = epoch.batch_starts_before_exchange(position, trainer.accumulate_grad_batches)
        if starts is None:  # their next collective comes before the forward of the batch this rank left at
            return
        if layout.catch_up is not None:
            layout.catch_up()
        _lightning.join_batch_starts(trainer, starts)

    return run


def checkpoint_state(epochs: Epochs, trainer: pl.Trainer, distributed: bool) -> dict[str, Any]:
    """What a checkpoint keeps of the strategy: the mode's counters, the K in force and, for stateful loaders, every
    rank's position (an all-gather)."""
    state: dict[str, Any] = epochs.mode.state_dict()
    state["accumulate"] = trainer.accumulate_grad_batches
    epoch = epochs.current
    if epoch is not None and epoch.reader.stateful:
        state["loader_ranks"] = every_rank(epoch.reader, trainer.world_size, distributed)
    return state


def restore(state: Mapping[str, Any] | None, epochs: Epochs, world_size: int, rank: int,
            has_loader_states: bool) -> RankPosition | None:
    """Restore the mode's counters from a checkpoint's ``state``; this rank's saved position, if it holds one (its
    next pass then knows whether its loader had run out)."""
    if state is None:
        return None
    epochs.mode.load_state_dict(state)
    own = this_rank(state, world_size, rank) if has_loader_states else None
    if own is not None:
        epochs.resume(own.exhausted)
    return own


def step_disagreement(position: int, where: str, steps: bool) -> RuntimeError:
    """Lightning steps the optimizer after another batch than the window's last: a front end's one check per window."""
    what = "steps the optimizer after" if steps else "does not step the optimizer after"
    return RuntimeError(
        f"token_mean: Lightning {what} batch {position}, but {where} ends there only if it is its last: a batch was"
        " trained twice or skipped (an `optimizer_step` override that calls the closure twice, or an"
        " `on_train_batch_start` that returns -1 in the middle of a window, does this). Call the closure once per"
        " batch; if this is not such a case, please report it with your Trainer settings."
    )


def once(result: Any) -> Callable[[], Any]:
    """The closure the optimizer gets: the window's last micro-batch already ran, and must not run again."""
    calls = 0

    def replay() -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError(
                "token_mean: the optimizer evaluated the closure more than once in one step (as LBFGS does); that"
                " would count the window's items again. Use a first-order optimizer."
            )
        return result

    return replay



def _check_default_count(name: str, module: Module) -> None:
    """Refuse the default count for a model whose own loss shifts the labels (every rank holds the same classes)."""
    from token_mean._hf import label_shifting_model, shifted_labels_advice

    model = label_shifting_model(module)
    if model is not None:
        raise ValueError(shifted_labels_advice(name, model))


def check_fit(name: str, trainer: pl.Trainer, handles_gradient_accumulation: bool, count_fn_given: bool) -> None:
    """Refuse, at fit start, what the strategy cannot normalize exactly."""
    module = trainer.lightning_module
    if not count_fn_given:
        _check_default_count(name, module)
    accumulate = trainer.accumulate_grad_batches
    if not isinstance(accumulate, int) or accumulate < 1:
        # Lightning takes any value here and fails later, in its loop (0: ZeroDivisionError)
        raise ValueError(
            f"`accumulate_grad_batches` must be a positive int (the micro-batches of one optimizer step), got"
            f" {accumulate!r}: pass `Trainer(accumulate_grad_batches=K)` with K >= 1."
        )
    if not module.automatic_optimization:
        raise ValueError(
            f"`{name}` needs automatic optimization: with `automatic_optimization = False` the LightningModule"
            " calls backward itself and the strategy cannot normalize it. Use `token_mean.fabric."
            "TokenMeanAccumulator`'s pattern in your own step, or set `self.automatic_optimization = True`."
        )
    if _lightning.uses_dataloader_iter(trainer):
        raise ValueError(
            f"`{name}` does not support `training_step(self, dataloader_iter)`: the strategy must see every batch"
            " the step trains on, and Lightning cannot tell which micro-batch window a batch drawn from the"
            " iterator belongs to. Use `training_step(self, batch, batch_idx)`, or `DDPStrategy` with your own"
            " normalization."
        )
    if handles_gradient_accumulation:
        raise ValueError(
            f"`{name}` cannot normalize windows when `handles_gradient_accumulation` is True:"
            " the strategy would no longer see the accumulation windows."
        )
    for optimizer in trainer.strategy.optimizers:
        if isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.LBFGS):
            raise ValueError(
                f"`{name}` does not support `torch.optim.LBFGS`: it re-evaluates the closure within one step,"
                " which would count the window's items again. Use a first-order optimizer."
            )




__all__ = ["CHECKPOINT_KEY", "catch_up", "check_fit", "checkpoint_state", "once", "restore", "step_disagreement"]
