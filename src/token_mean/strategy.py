"""The token-mean Trainer strategies: ``TokenMeanStrategy``, the hooks both share, and ``TokenMeanDDPStrategy``.

``TokenMeanStrategy`` sits in front of a Lightning parallel strategy in the method resolution order (``class
TokenMeanDDPStrategy(TokenMeanStrategy, DDPStrategy)``). Its hooks are a few lines each: Lightning's loop hands
batches to the fit's :class:`~token_mean._epoch.Epochs` (``_lightning.read_through``), ``training_step`` takes the
micro-batch from the current epoch, ``backward`` runs what the micro-batch says, and ``optimizer_step`` steps after
the window's last. A strategy built on it says only what its parallel layout is (``_layout``) and where its
checkpoint state is restored.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from token_mean import _ddp, _lightning
from token_mean._arguments import check_parent_values, check_passed_through, named_parameters
from token_mean._core import Layout, checked_settings, make_mode
from token_mean._counting import CountFn
from token_mean._epoch import Epochs
from token_mean._exit import destroy_process_group_at_exit
from token_mean._mode import LossReduction, MicroBatch, Mode, StepOutput
from token_mean._trainer import CHECKPOINT_KEY, catch_up, check_fit, checkpoint_state, once, restore, step_disagreement
from token_mean.results import WindowStats


class _Fit(NamedTuple):
    """What a fit's hooks need: its trainer, and its passes over the training batches (their mode)."""

    trainer: pl.Trainer
    epochs: Epochs


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
        self._fit: _Fit | None = None  # the fit's trainer and passes (with its mode), from `setup` on
        self._micro: MicroBatch | None = None  # the micro-batch in flight, until its window's optimizer step
        self._last_window: WindowStats | None = None
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
        return 0 if self._fit is None else self._fit.epochs.mode.skipped_steps

    @property
    def is_filler_batch(self) -> bool:
        """True while the micro-batch in flight is a zero-weight repeat of an exhausted rank: in its
        ``training_step`` and its backward (``on_before_backward``, ``on_after_backward``), as ``token_mean.
        in_filler_batch()`` says; metrics, ``self.log`` and BatchNorm statistics see it unless they check
        (``TokenMeanLoss`` does)."""
        return self._micro is not None and self._micro.is_filler

    def track_rank_counts(self) -> None:
        """Publish every rank's count in ``last_window.rank_counts`` (P more floats in each window's collective).

        Call it before ``fit`` starts (a callback's ``setup`` does): the records of a fit keep one length.
        """
        self._track_rank_counts = True

    def _check_kwargs(self, mode: Mode, kwargs: Mapping[str, Any]) -> None:
        """Refuse the parent strategy's arguments that ``mode`` cannot combine with (none by default)."""

    @abstractmethod
    def _layout(self) -> Layout:
        """The core's view of the parallel layout (the model is wrapped)."""

    def _stand_in_loss(self) -> Tensor:
        """What the backward runs when ``training_step`` returned no loss, so this rank's collectives still run."""
        return _ddp.stand_in_loss(self._module())

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
        check_fit(type(self).__name__, trainer, self.handles_gradient_accumulation, self._settings.count_fn_given)
        layout = self._layout()
        mode = make_mode(self._mode_name, layout, self._settings, self._track_rank_counts)
        self._fit = _Fit(trainer, Epochs(mode, self._settings.pad_uneven_ranks, "epoch", catch_up(trainer, layout)))
        _lightning.read_through(trainer, self._fit.epochs)

    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _normalizing(self) -> _Fit | None:
        """The fit, but in an epoch without backward passes (SWA's BatchNorm epoch), which runs as plain DDP."""
        fit = self._fit
        if fit is None or _lightning.skips_backward(fit.trainer):
            return None
        return fit

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        fit = self._normalizing()
        if fit is not None and fit.epochs.current is not None:  # after the module's hook, whose -1 ends the epoch here
            fit.epochs.current.started(_lightning.batch_position(fit.trainer))

    @override
    def on_train_end(self) -> None:
        if self._fit is not None:
            self._fit.epochs.settle()  # this rank may have left the last epoch early
        super().on_train_end()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        fit = self._normalizing()
        if fit is None or fit.epochs.current is None:
            return super().training_step(*args, **kwargs)
        trainer, epoch = fit.trainer, fit.epochs.current
        position = _lightning.batch_position(trainer)
        micro = self._micro = epoch.micro_batch(position, trainer.accumulate_grad_batches, lambda: trainer.global_step)
        _lightning.follow(trainer, epoch)  # a stream's window reaches its stop
        if micro.last and not _lightning.steps_after_this_batch(trainer):  # once per window: Lightning agrees
            raise step_disagreement(position, micro.window.where, steps=False)
        output, returned = StepOutput.of(super().training_step(*args, **kwargs), self._stand_in_loss)
        micro.loss_to_backprop(output, args[0] if args else kwargs.get("batch"))
        return returned  # type: ignore[no-any-return]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        micro = self._micro
        if micro is None or micro.backprop is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the micro-batch's own share of 1/N, taken from training_step's loss: Lightning's copy divided by K is unused
        loss = super().backward(micro.backprop, optimizer, *args, **kwargs)
        micro.backward_done()
        if micro.last and self._fit is not None:  # the window's one host read: every rank raises before the
            # update, even if an `optimizer_step` override skips the step
            self._last_window = micro.window_result()
            _lightning.follow(self._fit.trainer, micro.window.epoch)  # a stream goes on, or ends
        return loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | Module | None = None, **kwargs: Any) -> Any:
        if self._normalizing() is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The window's last micro-batch first: its backward ends the window, so an empty window skips the update
        # and deferred's gradient is final before AMP's unscale, `on_before_optimizer_step` and clipping.
        result = closure()
        micro, self._micro = self._micro, None
        if micro is None or not micro.last:
            position = -1 if micro is None else micro.position
            raise step_disagreement(position, "no window" if micro is None else micro.window.where, steps=True)
        if micro.window_result().skipped:
            return None
        return super().optimizer_step(optimizer, once(result), model, **kwargs)

    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("token_mean: internal error: a fit hook ran without a LightningModule.")
        return module

    def _trainer(self) -> pl.Trainer:
        return self._module().trainer

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._fit is not None:
            checkpoint[CHECKPOINT_KEY] = checkpoint_state(self._fit.epochs, self._fit.trainer, self._distributed())
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _restore_token_mean_state(self, checkpoint: Mapping[str, Any], has_loader_states: bool) -> Any | None:
        """Restore the strategy's counters on resume; returns this rank's own loader states to load instead of rank
        0's (None: leave Lightning's, e.g. for an epoch-end checkpoint, whose loaders start afresh)."""
        if self._fit is None:
            return None
        own = restore(checkpoint.get(CHECKPOINT_KEY), self._fit.epochs, self.world_size, self.global_rank,
                      has_loader_states)
        return None if own is None else own.loaders


# DDPStrategy keeps its own named arguments and hands the rest to DistributedDataParallel when it wraps the model
# (after launch); `module` and `device_ids` it fills in itself.
_PASSED_THROUGH = named_parameters(DDPStrategy.__init__) | named_parameters(
    DistributedDataParallel.__init__, leave_out=("module", "device_ids")
)


class TokenMeanDDPStrategy(TokenMeanStrategy, DDPStrategy):
    r"""DDP with gradient accumulation that optimizes the mean loss over all valid items of each optimizer step.

    Plain DDP with ``accumulate_grad_batches=K`` optimizes a mean of means: every micro-batch's mean loss is divided
    by K and DDP averages the P ranks, so an item in a small micro-batch weighs more than an item in a large one.
    This strategy rescales each micro-batch so that the optimizer sees exactly

    .. math:: g = \frac{1}{N} \sum_{r, j} \sum_{i \in \text{valid}(r, j)} \nabla \ell_i, \qquad N = \sum_{r, j} n_{r, j}

    over all ranks r and micro-batches j of the window, the gradient of the unpartitioned run. Empty micro-batches
    and ranks with no valid items contribute zero (never 0/0) and still take part in every collective (a rank with
    no batch at all is refused); a window with N = 0 on all ranks changes neither the parameters nor the optimizer
    state.

    The count is whatever the objective averages over: valid target tokens (the default, ``labels != -100``),
    examples (``count_fn=token_mean.count_examples``) or a sum of sample weights (a float). Choosing it is choosing
    the objective.

    Each window costs one all-reduce of a small record, started after the window's last forward and read on the host
    once, after its last backward: no host sync between a window's first forward and its last backward. Problems
    (a bad count, a NaN loss, ranks out of step) travel in that record, so every rank raises the same
    :class:`~token_mean.DenominatorError` before the optimizer step.

    Modes:
        ``"lookahead"`` (default) counts each window's batches before its first backward, with ``count_fn`` on the
        batches as the loader yields them: the next window's batches are read one per micro-batch (at most K held)
        and their counts ride in the current window's record. Each micro-batch's loss, as ``training_step`` returns
        it, is scaled by P·n/N (Lightning's copy divided by K is not back-propagated), so every hook, clipping and
        ``on_after_backward`` sees the final gradient scale, and ``training_step`` may
        return ``{"loss": token_mean_part, "aux_loss": term}``: the auxiliary term is averaged over the window's real
        micro-batches on all ranks instead. ``"deferred"`` reads nothing ahead: it counts each micro-batch after its
        forward (``count_fn`` or the ``"num_items"`` ``training_step`` returns), back-propagates local loss sums and
        corrects the scale inside DDP's gradient all-reduce of the window's last backward. Use it when the count is
        decided inside the model, when the loader must not be read ahead (it refills one buffer), or when K batches
        do not fit in host memory.

    Args:
        count_fn: ``count_fn(batch)`` gives the number of valid items of one micro-batch (an int, a float or a
            one-element tensor), for the batch ``training_step`` receives (with several training loaders, the
            combined batch). In lookahead mode it sees the batch before it is moved to the device. Defaults to
            :func:`~token_mean.count_valid_labels`.
        loss_reduction: what ``training_step`` returns: ``"mean"`` over the micro-batch's valid items (what
            ``F.cross_entropy(..., ignore_index=-100)`` gives) or their ``"sum"``.
        mode: ``"lookahead"`` or ``"deferred"``.
        pad_uneven_ranks: when the ranks' training loaders have different lengths (per-rank shards,
            :class:`~token_mean.ExactDistributedSampler`, streams that end at different batches), a rank that runs
            out repeats its last batch at weight zero until the longest rank is done (``is_filler_batch`` is True
            meanwhile), so all ranks run the same windows. With ``False``, different lengths are an error.
        \**kwargs: passed unchanged to :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``,
            ``process_group_backend``, ``timeout``, ``find_unused_parameters``, ...).

    Raises:
        ValueError: for an unknown ``mode`` or ``loss_reduction``, a ``count_fn`` that is not callable, or a
            ``ddp_comm_hook`` in deferred mode; at fit start, on every rank, when no ``count_fn`` was given and the
            module holds a Hugging Face causal LM whose loss shifts the labels (``count_shifted_labels`` or, for
            labels already shifted, ``count_valid_labels``: an explicit count is always used as given).
        TypeError: for an argument neither ``DDPStrategy`` nor ``DistributedDataParallel`` takes (a ``Trainer``
            argument such as ``accumulate_grad_batches`` goes to the ``Trainer``).

    After each window, :attr:`last_window` holds a :class:`~token_mean.WindowStats`.

    Example:
        >>> import lightning.pytorch as pl
        >>> strategy = TokenMeanDDPStrategy(start_method="fork", process_group_backend="gloo")
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, accumulate_grad_batches=4,
        ...                      logger=False, enable_checkpointing=False)
        >>> trainer = pl.Trainer(strategy="ddp_token_mean_fork", accelerator="cpu", devices=2, logger=False,
        ...                      enable_checkpointing=False)
    """

    strategy_name = "ddp_token_mean"

    @override
    def _check_kwargs(self, mode: Mode, kwargs: Mapping[str, Any]) -> None:
        check_passed_through(type(self).__name__, "DDPStrategy` or `DistributedDataParallel", kwargs, _PASSED_THROUGH)
        check_parent_values(type(self).__name__, kwargs)
        if mode == "deferred" and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with `mode='deferred'`, which installs its own gradient"
                " all-reduce hook to apply the global denominator. Use `mode='lookahead'` or remove `ddp_comm_hook`."
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Without this override the subclass would re-register DDP's own twelve names.
        for name, start_method in (
            ("ddp_token_mean", "popen"),
            ("ddp_token_mean_spawn", "spawn"),
            ("ddp_token_mean_fork", "fork"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Token-mean DDP strategy with `start_method` '{start_method}'",
                    start_method=start_method,
                )

    @override
    def _layout(self) -> Layout:
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError("token_mean: internal error: the model is not wrapped in DDP at fit start.")
        return _ddp.layout(model, self.root_device)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # called on resume only (not for weights-only loading), on every rank, after the loops were restored
        super().load_optimizer_state_dict(checkpoint)
        own = self._restore_token_mean_state(checkpoint, _lightning.has_loader_states_to_load(self._trainer()))
        if own is not None:
            _lightning.set_loader_states_to_load(self._trainer(), own)


TokenMeanDDPStrategy.register_strategies(StrategyRegistry)


__all__ = ["TokenMeanDDPStrategy", "TokenMeanStrategy"]
