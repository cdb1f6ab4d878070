"""The token-mean Trainer strategies: ``TokenMeanStrategy``, the hooks they share, and ``TokenMeanDDPStrategy``.

``TokenMeanStrategy`` comes before a Lightning parallel strategy in the method resolution order. Lightning's loop
reads its training batches through the fit's :class:`~token_mean._epoch.Passes`, ``training_step`` takes the
micro-batch from the current pass, ``backward`` ends the window after its last, and ``optimizer_step`` steps after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from token_mean import _lightning
from token_mean._checkpoint import CHECKPOINT_KEY, checkpoint_state, restore
from token_mean._epoch import Epoch, Passes
from token_mean._exit import destroy_process_group_at_exit
from token_mean._layout import Layout, layout, stand_in_loss
from token_mean._modes import make_mode
from token_mean._observers import FirstWindowObserver, Replay, first_window_observers
from token_mean._settings import (
    CountFn,
    LossReduction,
    Mode,
    Settings,
    check_passed_through,
    checked_settings,
    named_parameters,
)
from token_mean._window import MicroBatch, StepOutput, Window, trained_twice_or_skipped
from token_mean.errors import DenominatorError
from token_mean.results import WindowStats


class TokenMeanStrategy(ParallelStrategy):
    """The base of the token-mean Trainer strategies: ``isinstance(trainer.strategy, TokenMeanStrategy)``.

    Not a strategy by itself: a subclass also derives from a concrete Lightning strategy.
    """

    def __init__(
        self,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction = "mean",
        mode: Mode = "lookahead",
        pad_uneven_ranks: bool = True,
        check_count: bool = True,
        **kwargs: Any,
    ) -> None:
        self._settings = checked_settings(count_fn, loss_reduction, mode, pad_uneven_ranks, check_count)
        self._check_kwargs(kwargs)
        super().__init__(**kwargs)
        self._passes: Passes | None = None  # the fit's passes over the training batches (and its mode), from `setup`
        self._fitting: pl.Trainer | None = None  # the trainer of the fit, from `setup`
        self._micro: MicroBatch | None = None  # the micro-batch in flight, until its window's optimizer step
        self._last_window: WindowStats | None = None
        self._track_rank_counts = False
        self._unwrap_hook: Callable[[], None] | None = None  # undoes the -1 refusal's wrapper (picklable: None)
        self._first_window: list[FirstWindowObserver] = []  # layers that follow the fit's first window
        self._names = tuple(term.name for term in self._settings.terms)  # an objective of several terms

    @property
    def count_fn(self) -> CountFn:
        """The count of valid items of one micro-batch: the user's ``count_fn`` or the ``labels != -100`` default."""
        return self._settings.count_fn

    @property
    def loss_reduction(self) -> LossReduction:
        return self._settings.loss_reduction

    @property
    def mode(self) -> Mode:
        return self._settings.mode

    @property
    def settings(self) -> Settings:
        """Every objective setting as the strategy checked them (a monitor's audit replays with them)."""
        return self._settings

    @property
    def last_window(self) -> WindowStats | None:
        """What the last accumulation window used (None before the first ended)."""
        return self._last_window

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because their window had no valid item on any rank."""
        return 0 if self._passes is None else self._passes.mode.skipped_steps

    @property
    def is_filler_batch(self) -> bool:
        """True while the micro-batch in flight, from its ``training_step`` to its backward's hooks, is a zero-weight
        repeat of an exhausted rank's batch (``token_mean.in_filler_batch()``); metrics, ``self.log`` and BatchNorm
        statistics see it unless they check (``TokenMeanLoss`` does)."""
        return self._micro is not None and self._micro.is_filler

    def track_rank_counts(self) -> None:
        """Publish every rank's count in ``last_window.rank_counts`` (P more floats in each window's collective); call
        it before ``fit`` starts (a callback's ``setup`` does): the records of a fit keep one length."""
        self._track_rank_counts = True

    def _check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """Refuse the parent strategy's arguments the settings cannot combine with."""

    def _stand_in_loss(self) -> Tensor:
        """What the backward runs when ``training_step`` returned no loss, so this rank's collectives still run."""
        return stand_in_loss(self._module())

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # starts the process group
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            destroy_process_group_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # wraps the model
        if trainer.state.fn != TrainerFn.FITTING:
            return
        check_fit(type(self).__name__, trainer, self.handles_gradient_accumulation)
        if self.model is None:
            raise RuntimeError("token_mean: internal error: no model at fit start.")
        mode = make_mode(self._settings, self._layout(self.model), self._track_rank_counts)
        self._passes, self._fitting = Passes(mode, self._settings.pad_uneven_ranks, "epoch"), trainer
        _lightning.read_through(trainer, self._passes)
        self._unwrap_hook = _lightning.refuse_early_epoch_end(trainer.lightning_module, self._left_early)
        self._first_window = first_window_observers(self._settings, replayable=True)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._passes is not None and _lightning.sizes_the_training_loader(self._fitting):
            self._passes.check_loader(sized_len(dataloader))  # before Lightning's collective, which some ranks skip
        return super().process_dataloader(dataloader)

    def _layout(self, model: Module) -> Layout:
        return layout(self, model)

    def _left_early(self, batch_idx: int) -> Exception | None:
        return None if self._normalizing() is None else _early_end(batch_idx, self.global_rank)

    def _normalizing(self) -> tuple[pl.Trainer, Epoch] | None:
        """The fit's trainer and current pass, but not in an epoch without backward passes (SWA's BatchNorm epoch,
        which runs as plain DDP)."""
        passes, trainer = self._passes, self._fitting
        if passes is None or trainer is None or passes.current is None or _lightning.skips_backward(trainer):
            return None
        return trainer, passes.current

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        fit = self._normalizing()
        if fit is None:
            return super().training_step(*args, **kwargs)
        trainer, epoch = fit
        position = _lightning.batch_position(trainer)
        micro = self._micro = epoch.micro_batch(position, trainer.accumulate_grad_batches, lambda: trainer.global_step)
        _check_lightning_steps(trainer, micro)
        batch = args[0] if args else kwargs.get("batch")
        for observer in self._first_window:
            observer.micro_batch(batch, micro.is_filler, position)
        raw = super().training_step(*args, **kwargs)
        for observer in self._first_window:
            observer.trained(raw)
        output, returned = StepOutput.of(raw, self._stand_in_loss, self._names)
        micro.loss_to_backprop(output, batch)
        return returned  # type: ignore[no-any-return]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        micro, passes = self._micro, self._passes
        if micro is None or micro.backprop is None or passes is None or passes.current is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the micro-batch's own share of 1/N, taken from training_step's loss: Lightning's copy divided by K is unused
        loss = super().backward(micro.backprop, optimizer, *args, **kwargs)
        micro.backward_done()
        if micro.last:  # the window's one host read: every rank raises before the update, even if it is skipped
            self._last_window = passes.current.end_window()
            if self._fitting is not None:
                _lightning.end_epoch_with(self._fitting, passes.current)  # a stream goes on, or ends
        return loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._micro is None and self._normalizing() is None:  # the micro-batch in flight says: normalizing
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The window's last micro-batch first: its backward ends the window, so an empty window skips the update
        # and deferred's gradient is final before AMP's unscale, `on_before_optimizer_step` and clipping.
        result = closure()
        micro, self._micro = self._micro, None
        micro = _ended_window(micro)
        if self._first_window:  # the fit's first window ended (its count check runs here, on every rank)
            observers, self._first_window = self._first_window, []
            _first_window_ended(self, observers, micro.window)
        if self._last_window is not None and self._last_window.skipped:
            return None
        return super().optimizer_step(optimizer, closure_run_already(result), model, **kwargs)

    @override
    def teardown(self) -> None:
        if self._unwrap_hook is not None:
            self._unwrap_hook()
            self._unwrap_hook = None
        super().teardown()

    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("token_mean: internal error: a fit hook ran without a LightningModule.")
        return module

    def _trainer(self) -> pl.Trainer:
        return self._fitting if self._fitting is not None else self._module().trainer

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._passes is not None:
            accumulate = self._trainer().accumulate_grad_batches
            checkpoint[CHECKPOINT_KEY] = checkpoint_state(self._passes, accumulate, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _restore_token_mean_state(self, checkpoint: Mapping[str, Any], has_loader_states: bool) -> Any | None:
        """Restore the strategy's counters on resume; returns this rank's own loader states to load instead of rank
        0's (None: leave Lightning's)."""
        passes, state = self._passes, checkpoint.get(CHECKPOINT_KEY)
        return None if passes is None else restore(state, passes, self.world_size, self.global_rank, has_loader_states)


def _early_end(batch_idx: int, rank: int) -> DenominatorError:
    return DenominatorError(
        f"token_mean: `on_train_batch_start` returned -1 at batch {batch_idx} on rank {rank}, ending"
        " this rank's epoch there. The ranks of a token-mean fit train every accumulation window together, and"
        " the package does not end one early: on some ranks only, the others would wait in its collectives."
        "\n  Fix: end epochs early with `limit_train_batches` or `max_steps` (the same on every rank) instead of"
        " returning -1."
    )


def _first_window_ended(strategy: TokenMeanStrategy, observers: list[FirstWindowObserver], window: Window) -> None:
    """The observers of the fit's first window see it end, replaying `training_step` (its `self.log` dropped)."""
    context = strategy.precision_plugin.train_step_context
    world = window.channel.world
    replay = Replay(strategy._module(), _lightning.replay_training_step, context, world, "`training_step`")
    for observer in observers:
        observer.ended(replay, window.where)


def _check_lightning_steps(trainer: pl.Trainer, micro: MicroBatch) -> None:
    """Once per window: Lightning steps the optimizer after the window's last micro-batch."""
    if micro.last and not _lightning.steps_after_this_batch(trainer):
        raise trained_twice_or_skipped(
            f"Lightning does not step the optimizer after batch {micro.position}, the last of {micro.window.where}"
        )


def _ended_window(micro: MicroBatch | None) -> MicroBatch:
    """The micro-batch Lightning steps after: the last of a window that its backward ended."""
    if micro is None or not micro.last or not micro.window.ended:
        what = "no window" if micro is None else micro.window.where
        position = -1 if micro is None else micro.position
        raise trained_twice_or_skipped(
            f"Lightning steps the optimizer after batch {position}, but {what} ends there only if it is its last"
        )
    return micro


def check_fit(name: str, trainer: pl.Trainer, handles_gradient_accumulation: bool) -> None:
    """Refuse, at fit start, what the strategy cannot normalize exactly."""
    module = trainer.lightning_module
    accumulate = trainer.accumulate_grad_batches
    if not isinstance(accumulate, int) or accumulate < 1:
        # Lightning takes any value here and fails later, in its loop (0: ZeroDivisionError)
        raise ValueError(
            f"`accumulate_grad_batches` must be a positive int (the micro-batches of one optimizer step), got"
            f" {accumulate!r}: pass `Trainer(accumulate_grad_batches=K)` with K >= 1."
        )
    _lightning.refuse_static_graph(trainer.strategy, name, "accumulate_grad_batches", accumulate)
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


def closure_run_already(result: Any) -> Callable[[], Any]:
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


# DDPStrategy keeps its own named arguments and hands the rest to DistributedDataParallel when it wraps the model
# (after launch); `module` and `device_ids` it fills in itself.
_PASSED_THROUGH = named_parameters(DDPStrategy.__init__) | named_parameters(
    DistributedDataParallel.__init__, leave_out=("module", "device_ids")
)


class TokenMeanDDPStrategy(TokenMeanStrategy, DDPStrategy):
    r"""DDP with gradient accumulation that optimizes the mean loss over all valid items of each optimizer step.

    Plain DDP with ``accumulate_grad_batches=K`` optimizes a mean of means: each micro-batch's mean loss is divided by
    K and DDP averages the P ranks, so an item of a small micro-batch weighs more than one of a large. This strategy
    makes the optimizer see the gradient of the unpartitioned run,

    .. math:: g = \frac{1}{N} \sum_{r, j} \sum_{i \in \text{valid}(r, j)} \nabla \ell_i, \qquad N = \sum_{r, j} n_{r, j}

    over all ranks r and micro-batches j of the window. Empty micro-batches and ranks contribute zero (never 0/0)
    and still take part in every collective; a window with N = 0 on all ranks changes nothing. The count is what the
    objective averages over: valid target tokens (the default), examples, a sum of weights. Each window costs one
    all-reduce of a small record, read on the host once after its last backward; a problem on any rank raises the
    same :class:`~token_mean.DenominatorError` on every rank before the optimizer step.

    Modes (``docs/modes.md``): ``"lookahead"`` (default) counts each window's batches as the loader yields them,
    before its first backward, and scales each micro-batch's loss by P·n/N, so every hook and clipping sees the final
    gradient; ``training_step`` may return ``{"loss": ..., "aux_loss": ...}``, the auxiliary term averaged over the
    window's real micro-batches. ``"deferred"`` reads nothing ahead: it counts each micro-batch after its forward
    (``count_fn``, or the step's ``"num_items"``) and corrects the scale inside DDP's gradient all-reduce of the
    window's last backward; use it when the model decides the mask, the loader refills one buffer, or K batches do
    not fit in host memory.

    Args:
        count_fn: the valid items of one micro-batch (an int, a float or a one-element tensor) for the batch
            ``training_step`` receives (in lookahead, before it is moved to the device). Defaults to
            :func:`~token_mean.count_valid_labels`.
        loss_reduction: what ``training_step`` returns: the ``"mean"`` over the micro-batch's valid items or their
            ``"sum"``.
        mode: ``"lookahead"`` or ``"deferred"``.
        pad_uneven_ranks: a rank whose loader runs out repeats its last batch at weight zero until the longest rank
            is done (``is_filler_batch``), so all ranks run the same windows; with ``False``, an error.
        \**kwargs: passed unchanged to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Raises:
        ValueError: for an unknown ``mode`` or ``loss_reduction``, or a ``ddp_comm_hook`` in deferred mode; at fit
            start, for a setup it cannot normalize exactly (``docs/guarantees.md``).
        TypeError: for a ``count_fn`` that is not callable, or an argument neither ``DDPStrategy`` nor
            ``DistributedDataParallel`` takes (a ``Trainer`` argument goes to the ``Trainer``).

    Example:
        >>> import lightning.pytorch as pl
        >>> strategy = TokenMeanDDPStrategy(start_method="fork", process_group_backend="gloo")
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, accumulate_grad_batches=4,
        ...                      logger=False, enable_checkpointing=False)
        >>> trainer.strategy is strategy, strategy.mode, strategy.loss_reduction, trainer.accumulate_grad_batches
        (True, 'lookahead', 'mean', 4)
        >>> by_name = pl.Trainer(strategy="ddp_token_mean_fork", accelerator="cpu", devices=2, logger=False,
        ...                      enable_checkpointing=False)
        >>> type(by_name.strategy).__name__, by_name.strategy.count_fn.__name__
        ('TokenMeanDDPStrategy', 'count_valid_labels')
    """

    strategy_name = "ddp_token_mean"

    @override
    def _check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        check_passed_through(type(self).__name__, "DDPStrategy` or `DistributedDataParallel", kwargs, _PASSED_THROUGH)
        if self._settings.mode == "deferred" and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with `mode='deferred'`, which installs its own gradient"
                " all-reduce hook to apply the global denominator. Use `mode='lookahead'` or remove `ddp_comm_hook`."
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Without this override the subclass would re-register DDP's own twelve names.
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            name = f"ddp_token_mean{suffix}"
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    start_method=start_method,
                    description=f"Token-mean DDP strategy with `start_method` '{start_method}'",
                )

    @override
    def _layout(self, model: Module) -> Layout:
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError("token_mean: internal error: the model is not wrapped in DDP at fit start.")
        return layout(self, model)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # called on resume only (not for weights-only loading), on every rank, after the loops were restored
        super().load_optimizer_state_dict(checkpoint)
        _lightning.load_own_loader_states(self._trainer(), partial(self._restore_token_mean_state, checkpoint))


TokenMeanDDPStrategy.register_strategies(StrategyRegistry)


__all__ = ["TokenMeanDDPStrategy", "TokenMeanStrategy"]
