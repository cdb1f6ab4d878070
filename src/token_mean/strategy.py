"""``TokenMeanDDPStrategy``: DDP whose optimizer step follows the mean loss over all valid items of the step."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from token_mean import _lightning
from token_mean._counting import CountFn, count_valid_labels
from token_mean._deferred import Deferred
from token_mean._filler import filler_batch
from token_mean._loaders import agree_on_length, gather_objects, length_is_a_hint
from token_mean._lookahead import Lookahead
from token_mean._mode import LossReduction, Settings, StepOutput, WindowMode, World
from token_mean._reader import Reader
from token_mean._window import WindowStats

Mode = Literal["lookahead", "deferred"]
_MODES: tuple[Mode, ...] = ("lookahead", "deferred")
_LOSS_REDUCTIONS: tuple[LossReduction, ...] = ("mean", "sum")
_CHECKPOINT_KEY = "token_mean"
_MODE_CLASSES: dict[Mode, type[WindowMode]] = {"lookahead": Lookahead, "deferred": Deferred}


class TokenMeanDDPStrategy(DDPStrategy):
    r"""DDP with gradient accumulation that optimizes the mean loss over all valid items of each optimizer step.

    Plain DDP with ``accumulate_grad_batches=K`` optimizes a mean of means: every micro-batch's mean loss is divided
    by K and DDP averages the P ranks, so an item in a small micro-batch weighs more than an item in a large one.
    This strategy rescales each micro-batch so that the optimizer sees exactly

    .. math:: g = \frac{1}{N} \sum_{r, j} \sum_{i \in \text{valid}(r, j)} \nabla \ell_i, \qquad N = \sum_{r, j} n_{r, j}

    over all ranks r and micro-batches j of the window, the gradient of the unpartitioned run. Empty micro-batches
    and empty ranks contribute zero (never 0/0) and still take part in every collective; a window with N = 0 on all
    ranks changes neither the parameters nor the optimizer state.

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
        and their counts ride in the current window's record. Each micro-batch's loss is scaled by K·P·n/N, so
        every hook, clipping and ``on_after_backward`` sees the final gradient scale, and ``training_step`` may
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
            ``ddp_comm_hook`` in deferred mode.

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

    def __init__(
        self,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction = "mean",
        mode: Mode = "lookahead",
        pad_uneven_ranks: bool = True,
        **kwargs: Any,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}.")
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(
                f"`loss_reduction` must be one of {_LOSS_REDUCTIONS}, got {loss_reduction!r}: 'mean' if `training_step`"
                " returns the mean over the micro-batch's valid items, 'sum' if it returns their sum."
            )
        if count_fn is not None and not callable(count_fn):
            raise ValueError(
                f"`count_fn` must be a callable `count_fn(batch) -> int | float | Tensor`, got {count_fn!r}."
            )
        if mode == "deferred" and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with `mode='deferred'`, which installs its own gradient"
                " all-reduce hook to apply the global denominator. Use `mode='lookahead'` or remove `ddp_comm_hook`."
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

    # ------------------------------------------------------------------------------------------------------------
    # set-up: checks that need the Trainer, the mode, and the fit loop's batches routed through the reader
    # ------------------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        world = World(
            size=self.world_size,
            rank=self.global_rank,
            device=self.root_device,
            group=None,
            distributed=self.world_size > 1 and dist.is_available() and dist.is_initialized(),
        )
        settings = Settings(self.count_fn, self._count_fn is not None, self._loss_reduction, self._pad_uneven_ranks)
        self._mode = _MODE_CLASSES[self._mode_name](world, settings)
        self._mode.track_rank_counts = self._track_rank_counts
        super().setup(trainer)  # wraps the model in DDP, which registers the mode's gradient hook
        self._check_setup(trainer)
        _lightning.read_through(trainer, self._on_iter, self._on_setup_data)

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

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert self._mode is not None and isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        self._mode.attach(self.model)

    def _on_setup_data(self, loaders: list[Any], local_length: int | None) -> None:
        """Lightning sized the epoch from this rank's loaders: every rank takes the longest (one all-reduce)."""
        if length_is_a_hint(loaders):
            local_length = None
        distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        length = agree_on_length(local_length, self.root_device if distributed else None, self._pad_uneven_ranks)
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
        state: dict[str, Any] = {"skipped_steps": 0 if mode is None else mode.skipped_steps}
        if isinstance(mode, Deferred):
            state["provisional"] = mode.provisional()
        reader = None if mode is None else mode.reader
        if reader is not None and reader.stateful:
            local = {"loaders": reader.consumed_state(), "exhausted": reader.exhausted}
            distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
            state["loader_ranks"] = gather_objects(local, self.world_size) if distributed else [local]
        checkpoint[_CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # called on resume only (not for weights-only loading), on every rank, after the loops were restored
        super().load_optimizer_state_dict(checkpoint)
        state = checkpoint.get(_CHECKPOINT_KEY)
        if state is None:
            return
        if self._mode is not None:
            self._mode.skipped_steps = int(state.get("skipped_steps", 0))
            if isinstance(self._mode, Deferred):
                self._mode.restore_provisional(state.get("provisional"))
        ranks = state.get("loader_ranks")
        trainer = self._trainer()
        if ranks is None or not _lightning.has_loader_states_to_load(trainer):
            return  # an epoch-end checkpoint: the loaders start afresh
        if len(ranks) != self.world_size:
            raise ValueError(
                f"token_mean: the checkpoint was written mid-epoch by {len(ranks)} processes, each at its own"
                f" position in its shard, but it is resumed with {self.world_size} processes. Resume mid-epoch with"
                f" {len(ranks)} processes, or from a checkpoint written at the end of an epoch."
            )
        own = ranks[self.global_rank]
        _lightning.set_loader_states_to_load(trainer, own["loaders"])
        self._resume["exhausted"] = own["exhausted"]


TokenMeanDDPStrategy.register_strategies(StrategyRegistry)
