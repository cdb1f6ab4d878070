"""``TokenMeanStrategy``: the Lightning Trainer hooks both token-mean strategies share, each a few lines that delegate.

It sits in front of a Lightning parallel strategy in the method resolution order (``class TokenMeanDDPStrategy(
TokenMeanStrategy, DDPStrategy)``) and drives a :class:`~token_mean._mode.WindowMode` through each accumulation
window: Lightning's loop → reader → mode → window, results returned. A strategy built on it says only what differs
between parallel layouts (the abstract methods below) and where its checkpoint state is restored.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from token_mean import _lightning
from token_mean._checkpoint import RankPosition, every_rank, this_rank
from token_mean._core import Layout, checked_settings, make_mode
from token_mean._counting import CountFn
from token_mean._exit import destroy_process_group_at_exit
from token_mean._filler import filler_batch
from token_mean._loaders import agree_on_length, length_is_a_hint
from token_mean._mode import LossReduction, Mode, StepOutput, WindowMode, WindowResult
from token_mean._reader import Reader
from token_mean._window import WindowStats

CHECKPOINT_KEY = "token_mean"


class TokenMeanStrategy(ParallelStrategy):
    """The base of the token-mean Trainer strategies: ``isinstance(trainer.strategy, TokenMeanStrategy)``.

    Not a strategy by itself: a subclass also derives from a concrete Lightning strategy and says what its parallel
    layout is (``_layout``).
    """

    def __init__(
        self,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction = "mean",
        mode: Mode = "lookahead",
        pad_uneven_ranks: bool = True,
        **kwargs: Any,
    ) -> None:
        self._settings, self._mode_name = checked_settings(count_fn, loss_reduction, mode, pad_uneven_ranks)
        self._check_kwargs(self._mode_name, kwargs)
        super().__init__(**kwargs)
        self._mode: WindowMode | None = None  # from the start of `fit`
        self._reader: Reader | None = None  # the fit loop's batches
        self._aux_loss: Tensor | None = None  # of the micro-batch in flight, for its backward
        self._ended: WindowResult | None = None  # the window whose last backward ran, until its optimizer step
        self._last_window: WindowStats | None = None
        self._resume: dict[str, Any] = {}  # this rank's loader position from a mid-epoch checkpoint
        self._epoch = _Epoch()
        self._track_rank_counts = False

    @property
    def count_fn(self) -> CountFn:
        """The count of valid items of one micro-batch: the user's ``count_fn`` or the ``labels != -100`` default."""
        return self._settings.count_fn

    @property
    def loss_reduction(self) -> LossReduction:
        return self._settings.loss_reduction

    @property
    def mode(self) -> Mode:
        return self._mode_name

    @property
    def last_window(self) -> WindowStats | None:
        """What the last accumulation window used (None before the first ended)."""
        return self._last_window

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because their window had no valid item on any rank."""
        return 0 if self._mode is None else self._mode.skipped_steps

    @property
    def is_filler_batch(self) -> bool:
        """True while the batch in flight is a zero-weight repeat of an exhausted rank (from its fetch to its
        backward): it runs the user's ``training_step``, so metrics, ``self.log`` and BatchNorm statistics see it
        unless they check this flag (``TokenMeanLoss`` does)."""
        current = None if self._reader is None else self._reader.current
        return current is not None and current.filler

    def track_rank_counts(self) -> None:
        """Publish every rank's count in ``last_window.rank_counts`` (P more floats in each window's collective).

        Call it before ``fit`` starts (a callback's ``setup`` does): the records of a fit keep one length.
        """
        self._track_rank_counts = True

    def _check_kwargs(self, mode: Mode, kwargs: Mapping[str, Any]) -> None:
        """Refuse the parent strategy's arguments that ``mode`` cannot combine with (none by default)."""

    @abstractmethod
    def _layout(self) -> Layout:
        """The ranks that share a denominator, deferred's gradient path, the window checks (the model is wrapped)."""

    def _stand_in_loss(self) -> Tensor:
        """What the backward runs when ``training_step`` returned no loss, so this rank's collectives still run."""
        from token_mean._ddp import stand_in_loss

        return stand_in_loss(self._module())

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # starts the process group
        if self._distributed():
            destroy_process_group_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # wraps the model
        if trainer.state.fn != TrainerFn.FITTING:
            return
        _check_fit(type(self).__name__, trainer, self.handles_gradient_accumulation, self._settings.count_fn_given)
        layout = self._layout()
        self._epoch.catch_up = layout.catch_up
        self._mode = make_mode(self._mode_name, layout, self._settings, self._track_rank_counts)
        _lightning.read_through(trainer, self._on_epoch, self._on_setup_data)

    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _on_setup_data(self, loaders: list[Any], local_length: int | None) -> None:
        """Lightning sized the epoch from this rank's loaders: every rank takes the longest (one all-reduce)."""
        assert self._mode is not None  # read_through is installed after the mode exists
        self._epoch.size(self._trainer(), self._mode, loaders, local_length, self._settings.pad_uneven_ranks)

    def _on_epoch(self, reader: Reader) -> None:
        """The fit loop starts a pass over the training batches (a new epoch, or a resumed one)."""
        assert self._mode is not None  # read_through is installed after the mode exists
        self._epoch.leave_if_left(self._trainer(), self._mode, self._distributed())
        # the length agreed when the loaders were set up (a callback may have resized Lightning's epoch since)
        reader.start_epoch(self._epoch.length, bool(self._resume.pop("exhausted", False)), self._epoch.limit)
        self._reader = reader
        self._mode.start_epoch(reader)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._normalizing() is not None:  # after the module's hook, whose -1 would end this rank's epoch here
            self._epoch.started = _lightning.epoch_position(self._trainer()) - 1

    @override
    def on_train_end(self) -> None:
        if self._mode is not None:
            self._epoch.leave_if_left(self._trainer(), self._mode, self._distributed())
        super().on_train_end()

    def _normalizing(self) -> WindowMode | None:
        """The mode, but in an epoch without backward passes (SWA's BatchNorm epoch), which runs as plain DDP."""
        if self._mode is None or _lightning.skips_backward(self._trainer()):
            return None
        return self._mode

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        mode = self._normalizing()
        if mode is None:
            return super().training_step(*args, **kwargs)
        trainer = self._trainer()
        position, last = _lightning.batch_position(trainer)
        self._epoch.train(position, trainer.accumulate_grad_batches)
        filler = mode.begin(position, last, trainer.accumulate_grad_batches, _step_name(trainer))
        self._epoch.follow_stream(trainer, self._reader)
        with filler_batch(filler):
            output = StepOutput.of(super().training_step(*args, **kwargs), self._stand_in_loss)
        mode.after_forward(args[0] if args else kwargs.get("batch"), output)
        self._aux_loss = output.aux_loss
        return output.returned  # type: ignore[no-any-return]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        mode = self._mode
        if mode is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        trainer = self._trainer()
        # Lightning divided the loss by K
        scaled = mode.scale(closure_loss, trainer.accumulate_grad_batches, self._aux_loss)
        self._aux_loss = None
        loss = super().backward(scaled, optimizer, *args, **kwargs)
        # After the window's last backward its record is read (the window's one host read): every rank raises
        # before the update, and the window ends here even if an `optimizer_step` override skips the step.
        ended = mode.after_backward()
        if ended is not None:
            self._ended, self._last_window = ended, ended.stats
            if ended.epoch_length is not None:
                _lightning.set_epoch_length(trainer, ended.epoch_length)
        return loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | Module | None = None, **kwargs: Any) -> Any:
        if self._normalizing() is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The window's last micro-batch first: its backward ends the window, so an empty window skips the update
        # and deferred's gradient is final before AMP's unscale, `on_before_optimizer_step` and clipping.
        result = closure()
        ended, self._ended = _window_ended(self._ended), None
        if ended.stats.skipped:
            return None
        return super().optimizer_step(optimizer, _once(result), model, **kwargs)

    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None  # the strategy's fit hooks run with a module attached
        return module

    def _trainer(self) -> pl.Trainer:
        return self._module().trainer

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        checkpoint[CHECKPOINT_KEY] = _state(self._mode, self._reader, self._trainer(), self._distributed())
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _restore_token_mean_state(self, checkpoint: Mapping[str, Any], has_loader_states: bool) -> Any | None:
        """Restore the strategy's counters on resume; returns this rank's own loader states to load instead of rank
        0's (None: leave Lightning's, e.g. for an epoch-end checkpoint, whose loaders start afresh)."""
        own = _restore(checkpoint.get(CHECKPOINT_KEY), self._mode, self._epoch, self.world_size, self.global_rank,
                       has_loader_states)
        if own is None:
            return None
        self._resume["exhausted"] = own.exhausted
        return own.loaders


class _Epoch:
    """The training epoch as this rank runs it: the length the ranks agreed on, this rank's own limit, and the batch
    it started and trained last (one started but never trained: ``on_train_batch_start`` returned -1)."""

    def __init__(self) -> None:
        self.length: int | None = None
        self.limit: int | None = None
        self.started: int | None = None
        self.trained: int | None = None
        self.catch_up: Callable[[], None] | None = None  # what the others' next forward runs (the layout's)
        self.saved_accumulate: int | None = None  # K in the checkpoint being resumed, until the first batch

    def size(self, trainer: pl.Trainer, mode: WindowMode, loaders: list[Any], local: int | None, pad: bool) -> None:
        if length_is_a_hint(loaders):
            local = None
        self.length = agree_on_length(mode.channel, local, pad)
        # `limit_train_batches` limits each rank to its own share (a fraction of its own length): past it, fillers
        self.limit = local if trainer.limit_train_batches != 1.0 else None
        _lightning.resize_epoch(trainer, self.length)

    def train(self, position: int, accumulate: int) -> None:
        """Batch ``position`` is trained with K = ``accumulate``; the first after a resume is checked against the
        K the checkpoint was written with."""
        self.trained = position
        saved, self.saved_accumulate = self.saved_accumulate, None
        if saved is not None and position > 0 and saved != accumulate:
            from lightning.fabric.utilities import rank_zero_warn

            rank_zero_warn(
                f"token_mean: this run resumed in the middle of an epoch (at batch {position}) with"
                f" `accumulate_grad_batches` = {accumulate}, but the checkpoint was written with {saved}. Lightning"
                " skips `on_train_epoch_start` on a mid-epoch restart, so a `GradientAccumulationScheduler` (or a"
                " callback that sets K there) has not set this epoch's K: the rest of the epoch trains windows of"
                f" {accumulate} micro-batches (plain Lightning does the same), exact for those windows but not the"
                " uninterrupted run. Resume from a checkpoint written at the end of an epoch to keep the schedule."
            )

    @staticmethod
    def follow_stream(trainer: pl.Trainer, reader: Reader | None) -> None:
        """A stream's epoch ends where the ranks agreed: a window recounted where it starts, because a callback
        changed K there, reaches further than the end the last window's record agreed on."""
        if reader is not None and not reader.sized:
            _lightning.set_epoch_length(trainer, reader.length)

    def leave_if_left(self, trainer: pl.Trainer, mode: WindowMode, distributed: bool) -> None:
        """This rank's epoch ended at a batch it did not train: meet the others where they are (the batch starts
        Lightning still broadcasts in their window, then its exchange), so that every rank raises the same error
        instead of waiting for the process group's timeout; no error where every rank ended there."""
        started, trained = self.started, self.trained
        self.started = self.trained = None
        if started is None or started == trained or not distributed:
            return
        starts = mode.batch_starts_before_exchange(started, trainer.accumulate_grad_batches)
        if starts is not None:  # the others train batch `started`, then start `starts` more before the exchange
            if self.catch_up is not None:
                self.catch_up()
            _lightning.join_batch_starts(trainer, starts)
        mode.leave(started)


def _window_ended(ended: WindowResult | None) -> WindowResult:
    if ended is None:
        raise RuntimeError(
            "token_mean: internal error: the optimizer steps, but no accumulation window ended. Please report this"
            " with your Trainer settings."
        )
    return ended


def _state(mode: WindowMode | None, reader: Reader | None, trainer: pl.Trainer, distributed: bool) -> dict[str, Any]:
    """What a checkpoint keeps of the strategy: the mode's counters, the K in force and, for stateful loaders, every
    rank's position (an all-gather)."""
    state: dict[str, Any] = {} if mode is None else mode.state_dict()
    state["accumulate"] = trainer.accumulate_grad_batches
    if reader is not None and reader.stateful:
        state["loader_ranks"] = every_rank(reader, trainer.world_size, distributed)
    return state


def _restore(
    state: Mapping[str, Any] | None, mode: WindowMode | None, epoch: _Epoch, world_size: int, rank: int,
    has_loader_states: bool,
) -> RankPosition | None:
    """Restore the mode's counters from a checkpoint's ``state``; this rank's saved position, if it holds one."""
    if state is None:
        return None
    if mode is not None:
        mode.load_state_dict(state)
    epoch.saved_accumulate = state.get("accumulate")
    return this_rank(state, world_size, rank) if has_loader_states else None


def _step_name(trainer: pl.Trainer) -> str:
    """What errors call the optimizer step in flight: its index, `trainer.global_step` while it runs (the step
    Lightning logs its metrics under, and traces and the monitor number it by; docs/monitor.md)."""
    return f"optimizer step {trainer.global_step} (epoch {trainer.current_epoch}"


def _once(result: Any) -> Callable[[], Any]:
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


def _check_fit(name: str, trainer: pl.Trainer, handles_gradient_accumulation: bool, count_fn_given: bool) -> None:
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


__all__ = ["CHECKPOINT_KEY", "TokenMeanStrategy"]
