"""The Lightning hooks both token-mean strategies share: settings, set-up checks, one micro-batch, the step, state.

:class:`TokenMeanHooks` sits in front of a Lightning parallel strategy in the method resolution order
(``class TokenMeanDDPStrategy(TokenMeanHooks, DDPStrategy)``) and delegates every window to a
:class:`~token_mean._mode.WindowMode`. A strategy built on it says only what differs between parallel layouts:

- :meth:`TokenMeanHooks._world`: the ranks that share one denominator (all of them under DDP, the data-parallel ones
  under a device mesh) and the ranks that must agree on every count because they hold the same batch;
- :meth:`TokenMeanHooks._correct_gradients`: how a deferred window's final scale reaches the gradient when the
  strategy's own reduction cannot carry it (DDP folds it into its bucket all-reduce and does nothing here);
- where its checkpoint state is restored (the strategy's own restore hook calls :meth:`_restore_token_mean_state`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Literal

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
from token_mean._counting import CountFn, count_valid_labels
from token_mean._deferred import Deferred
from token_mean._exit import destroy_process_group_at_exit
from token_mean._filler import filler_batch
from token_mean._loaders import agree_on_length, gather_objects, length_is_a_hint
from token_mean._lookahead import Lookahead
from token_mean._mode import LossReduction, Settings, StepOutput, WindowMode, World
from token_mean._reader import Reader
from token_mean._window import WindowStats

Mode = Literal["lookahead", "deferred"]
MODES: tuple[Mode, ...] = ("lookahead", "deferred")
LOSS_REDUCTIONS: tuple[LossReduction, ...] = ("mean", "sum")
CHECKPOINT_KEY = "token_mean"
_MODE_CLASSES: dict[Mode, type[WindowMode]] = {"lookahead": Lookahead, "deferred": Deferred}


class TokenMeanHooks(ParallelStrategy):
    """Lightning hooks that route every accumulation window through a window mode (see the module docstring).

    Not a strategy by itself: a subclass also derives from a concrete Lightning strategy and implements ``_world``.
    """

    def __init__(
        self,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction = "mean",
        mode: Mode = "lookahead",
        pad_uneven_ranks: bool = True,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"`loss_reduction` must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}: 'mean' if `training_step`"
                " returns the mean over the micro-batch's valid items, 'sum' if it returns their sum."
            )
        if count_fn is not None and not callable(count_fn):
            raise ValueError(
                f"`count_fn` must be a callable `count_fn(batch) -> int | float | Tensor`, got {count_fn!r}."
            )
        super().__init__(**kwargs)
        self._count_fn = count_fn
        self._loss_reduction: LossReduction = loss_reduction
        self._mode_name: Mode = mode
        self._pad_uneven_ranks = pad_uneven_ranks
        self._mode: WindowMode | None = None
        self._aux_loss: Tensor | None = None
        self._told_length: int | None = None
        self._resume: dict[str, Any] = {}  # this rank's loader position from a mid-epoch checkpoint
        self._track_rank_counts = False

    @property
    def count_fn(self) -> CountFn:
        """The count of valid items of one micro-batch: the user's ``count_fn`` or the ``labels != -100`` default."""
        return self._count_fn or count_valid_labels

    @property
    def loss_reduction(self) -> LossReduction:
        return self._loss_reduction

    @property
    def mode(self) -> Mode:
        return self._mode_name

    @property
    def last_window(self) -> WindowStats | None:
        """What the last optimizer step used (None before the first)."""
        return None if self._mode is None else self._mode.last_stats

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because their window had no valid item on any rank."""
        return 0 if self._mode is None else self._mode.skipped_steps

    @property
    def is_filler_batch(self) -> bool:
        """True while the batch in flight is a zero-weight repeat of an exhausted rank (its hooks, ``training_step``).

        Such a batch contributes nothing to the objective, but it runs the user's ``training_step``: metrics,
        ``self.log`` and BatchNorm statistics see it unless they check this flag (``TokenMeanLoss`` and
        ``DenominatorMonitor`` do).
        """
        reader = None if self._mode is None else self._mode.reader
        return reader is not None and reader.current is not None and reader.current.filler

    def track_rank_counts(self) -> None:
        """Publish every rank's count in ``last_window.rank_counts`` (P more floats in each window's collective)."""
        self._track_rank_counts = True
        if self._mode is not None:
            self._mode.track_rank_counts = True

    # ------------------------------------------------------------------------------------------------------------
    # what a strategy built on these hooks says
    # ------------------------------------------------------------------------------------------------------------

    @abstractmethod
    def _world(self) -> World:
        """The ranks that share one denominator, and those that must agree on every count (process group is up)."""

    def _correct_gradients(self, mode: WindowMode) -> None:
        """After the window's last backward, before its record is read: bring a final scale to the gradient.

        The default does nothing: the strategy's gradient reduction already carried it (DDP's comm hook).
        """

    # ------------------------------------------------------------------------------------------------------------
    # set-up: checks that need the Trainer, the mode, and the fit loop's batches routed through the reader
    # ------------------------------------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # starts the process group
        if self._distributed():
            destroy_process_group_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        settings = Settings(self.count_fn, self._count_fn is not None, self._loss_reduction, self._pad_uneven_ranks)
        self._mode = _MODE_CLASSES[self._mode_name](self._world(), settings)
        self._mode.track_rank_counts = self._track_rank_counts
        super().setup(trainer)  # wraps the model (DDP registers the mode's gradient hook there)
        self._check_setup(trainer)
        _lightning.read_through(trainer, self._on_iter, self._on_setup_data)

    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _check_setup(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        name = type(self).__name__
        if not module.automatic_optimization:
            raise ValueError(
                f"`{name}` needs automatic optimization: with `automatic_optimization = False` the LightningModule"
                " calls backward itself and the strategy cannot normalize it. Divide the summed loss by the"
                " all-reduced count yourself, or set `self.automatic_optimization = True`."
            )
        if _lightning.uses_dataloader_iter(trainer):
            raise ValueError(
                f"`{name}` does not support `training_step(self, dataloader_iter)`: the strategy must see every batch"
                " the step trains on, and Lightning cannot tell which micro-batch window a batch drawn from the"
                " iterator belongs to. Use `training_step(self, batch, batch_idx)`, or `DDPStrategy` with your own"
                " normalization."
            )
        if self.handles_gradient_accumulation:
            raise ValueError(
                f"`{name}` cannot normalize windows when `handles_gradient_accumulation` is True:"
                " the strategy would no longer see the accumulation windows."
            )
        for optimizer in self.optimizers:
            if isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.LBFGS):
                raise ValueError(
                    f"`{name}` does not support `torch.optim.LBFGS`: it re-evaluates the closure within one step,"
                    " which would count the window's items again. Use a first-order optimizer."
                )

    def _on_setup_data(self, loaders: list[Any], local_length: int | None) -> None:
        """Lightning sized the epoch from this rank's loaders: every rank takes the longest (one all-reduce)."""
        if length_is_a_hint(loaders):
            local_length = None
        device = self.root_device if self._distributed() else None
        length = agree_on_length(local_length, device, self._pad_uneven_ranks)
        _lightning.resize_epoch(self._trainer(), length)

    def _on_iter(self, reader: Reader) -> None:
        """The fit loop starts a pass over the training batches (a new epoch, or a resumed one)."""
        assert self._mode is not None
        trainer = self._trainer()
        length = trainer.fit_loop.max_batches
        sized = length != float("inf")
        exhausted = bool(self._resume.pop("exhausted", False))
        self._mode.start_epoch(reader, int(length) if sized else None, exhausted)
        self._told_length = None

    # ------------------------------------------------------------------------------------------------------------
    # one micro-batch: delegate to the mode
    # ------------------------------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        mode = self._mode
        if mode is None:
            return super().training_step(*args, **kwargs)
        trainer = self._trainer()
        position, steps_now = _lightning.batch_position(trainer)
        filler = mode.begin(position, steps_now, trainer.accumulate_grad_batches, self._step_name(trainer))
        self._sync_epoch_length(trainer)
        with filler_batch(filler):
            output = StepOutput.of(super().training_step(*args, **kwargs), self._stand_in_loss)
        batch = args[0] if args else kwargs.get("batch")
        mode.after_forward(batch, output, steps_now)
        self._aux_loss = output.aux_loss
        return output.returned  # type: ignore[no-any-return]

    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None  # the strategy's fit hooks run with a module attached
        return module

    def _trainer(self) -> pl.Trainer:
        return self._module().trainer

    @staticmethod
    def _step_name(trainer: pl.Trainer) -> str:
        return f"optimizer step {trainer.global_step + 1} (epoch {trainer.current_epoch}"

    def _stand_in_loss(self) -> Tensor:
        """A zero touching every parameter, so DDP's reducer still fires until every rank raises at the window end."""
        parameters = [p for p in self._module().parameters() if p.requires_grad]
        return torch.stack([p.sum() * 0.0 for p in parameters]).sum()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._mode is not None:
            closure_loss = self._mode.scale(closure_loss, self._aux_loss)
            self._aux_loss = None
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._mode is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # Run the window's last micro-batch first: afterwards the window's record is read (the one host read of the
        # window), so every rank raises before the update, an empty window skips it, and in deferred mode the
        # gradient is final before AMP's unscale, `on_before_optimizer_step` and clipping.
        result = closure()
        self._correct_gradients(self._mode)
        trainer = self._trainer()
        stats, _ = self._mode.finish(self._step_name(trainer))
        self._sync_epoch_length(trainer)
        calls = 0

        def replay() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError(
                    "token_mean: the optimizer evaluated the closure more than once in one step (as LBFGS does);"
                    " that would count the window's items again. Use a first-order optimizer."
                )
            return result

        if stats.skipped:
            return None
        return super().optimizer_step(optimizer, replay, model, **kwargs)

    def _sync_epoch_length(self, trainer: pl.Trainer) -> None:
        """Unsized loaders: tell Lightning's fetcher where the ranks agreed the epoch ends."""
        reader = None if self._mode is None else self._mode.reader
        if reader is not None and not reader.sized and reader.length != self._told_length:
            self._told_length = reader.length
            _lightning.set_epoch_length(trainer, reader.length)

    # ------------------------------------------------------------------------------------------------------------
    # checkpoints: the loader's own state in Lightning's slot (plain Lightning can resume it), every rank's here
    # ------------------------------------------------------------------------------------------------------------

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        mode = self._mode
        state: dict[str, Any] = {} if mode is None else mode.state_dict()
        reader = None if mode is None else mode.reader
        if reader is not None and reader.stateful:
            local = {"loaders": reader.consumed_state(), "exhausted": reader.consumed_exhausted}
            state["loader_ranks"] = gather_objects(local, self.world_size) if self._distributed() else [local]
        checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _restore_token_mean_state(self, checkpoint: Mapping[str, Any], has_loader_states: bool) -> Any | None:
        """Restore the strategy's counters on resume; returns this rank's own loader states to load instead of rank
        0's (None: leave Lightning's, e.g. for an epoch-end checkpoint, whose loaders start afresh)."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            return None
        if self._mode is not None:
            self._mode.load_state_dict(state)
        ranks = state.get("loader_ranks")
        if ranks is None or not has_loader_states:
            return None
        if len(ranks) != self.world_size:
            raise ValueError(
                f"token_mean: the checkpoint was written mid-epoch by {len(ranks)} processes, each at its own"
                f" position in its shard, but it is resumed with {self.world_size} processes. Resume mid-epoch with"
                f" {len(ranks)} processes, or from a checkpoint written at the end of an epoch."
            )
        own = ranks[self.global_rank]
        self._resume["exhausted"] = own["exhausted"]
        return own["loaders"]


__all__ = ["CHECKPOINT_KEY", "LOSS_REDUCTIONS", "MODES", "Mode", "TokenMeanHooks"]
