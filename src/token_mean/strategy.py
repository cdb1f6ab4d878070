"""``TokenMeanDDPStrategy``: DDP whose optimizer step follows the mean loss over all valid items of the step."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from token_mean._comm_hook import scaled_allreduce_hook
from token_mean._counting import check_count, count_valid_labels
from token_mean._errors import DenominatorError
from token_mean._loader import Count, TrainIterator, wrap_loader
from token_mean._window import WindowStats

Mode = Literal["lookahead", "deferred"]
LossReduction = Literal["mean", "sum"]
_MODES = ("lookahead", "deferred")
_LOSS_REDUCTIONS = ("mean", "sum")

# Problems travel as 0/1 flags in the same collective as the counts, so every rank learns of them at once and raises
# the same error instead of leaving the others blocked in the next collective.
_PROBLEMS: tuple[tuple[str, str], ...] = (
    (
        "`count_fn` failed or returned something that is not a number",
        "make `count_fn(batch)` return an int, a float or a one-element tensor for every batch.",
    ),
    ("`count_fn` returned a negative count", "counts are numbers of valid items or sums of non-negative weights."),
    ("`count_fn` returned a NaN or infinite count", "check the weights or mask that `count_fn` sums."),
    (
        "`training_step` returned no loss (None, or a dict without 'loss')",
        "return the micro-batch's loss (a tensor, or a dict with a 'loss' key) from every `training_step`.",
    ),
    (
        "the loss of a micro-batch with valid items is NaN or infinite",
        "the data or the model diverged; lower the learning rate, enable gradient clipping or check the inputs.",
    ),
    (
        "`count_fn(batch)` and the 'num_items' returned by `training_step` disagree: two definitions of the"
        " denominator",
        "keep one of them: drop `count_fn` or stop returning 'num_items'.",
    ),
    (
        "the ranks' loaders ended at different batches, so the ranks' accumulation windows differ",
        "give every rank the same number of batches (Lightning's DistributedSampler does, with drop_last or padding).",
    ),
)
_COUNT_FAILED, _COUNT_NEGATIVE, _COUNT_NONFINITE, _NO_LOSS, _BAD_LOSS, _COUNT_MISMATCH, _UNEVEN = range(len(_PROBLEMS))
# record layout exchanged once per window (float64: counts are exact up to 2**53, float32 stops at 2**24)
_COUNT, _LOSS_SUM, _LENGTH, _FLAGS = 0, 1, 2, 3
_CHECKPOINT_KEY = "token_mean"


@dataclass
class _Window:
    """Book-keeping for the accumulation window being trained on (this rank only)."""

    start: int  # batch position in the epoch of the first micro-batch
    length: int  # micro-batches
    trained: int = 0
    global_count: float = 0.0
    rank_counts: tuple[float, ...] = ()
    grad_factor: float = 0.0  # lookahead: K·P/N for the loss; deferred: D/N for the gradient buckets
    provisional: float = 1.0  # deferred: D, the per-rank denominator the backward passes use until N is known
    count: Tensor | None = None  # deferred: running local count, on the device
    loss_sum: Tensor | None = None  # running local loss sum, on the device
    flags: Tensor | None = None  # running problem flags, on the device
    problem_detail: str = ""
    pending_counts: Callable[[], list[list[float]]] | None = None  # lookahead: the counts' gather, in flight


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
    examples (``count_fn=lambda b: len(b["labels"])``) or a sum of sample weights (a float). Choosing it is choosing
    the objective.

    Modes:
        ``"lookahead"`` (default) reads each window's batches ahead (at most K − 1 held), counts them with
        ``count_fn`` and all-gathers the counts once before the window's first backward; each micro-batch's loss is
        then scaled by K·P·n/N, so every hook, clipping and ``on_after_backward`` sees the final gradient scale.
        ``"deferred"`` reads nothing ahead: it counts each micro-batch after its forward (``count_fn`` or the
        ``"num_items"`` the ``training_step`` returns), back-propagates local loss sums and corrects the scale in
        DDP's gradient all-reduce of the window's last backward. Use it when the count is decided inside the model,
        when the loader must not be read ahead, or when K batches do not fit in host memory.

    Args:
        count_fn: ``count_fn(batch)`` gives the number of valid items of one micro-batch (an int, a float or a
            one-element tensor). In lookahead mode it sees the batch as the loader yields it, before it is moved to
            the device. Defaults to counting ``batch["labels"] != -100``.
        loss_reduction: what ``training_step`` returns: ``"mean"`` over the micro-batch's valid items (what
            ``F.cross_entropy(..., ignore_index=-100)`` gives) or their ``"sum"``.
        mode: ``"lookahead"`` or ``"deferred"``.
        pad_uneven_ranks: when the ranks' training loaders have different lengths (per-rank shards, or
            :class:`~token_mean.ExactDistributedSampler`), a rank that runs out repeats its last batch at weight zero
            until the longest rank is done, so all ranks run the same windows and take part in every collective.
            Costs one collective per epoch for a sized loader, and a two-flag collective per batch for an unsized one
            (an ``IterableDataset``), whose end cannot be known ahead. With ``False``, different lengths of sized
            loaders are an error and unsized loaders must end at the same batch on every rank.
        \**kwargs: passed unchanged to :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``,
            ``process_group_backend``, ``timeout``, ``find_unused_parameters``, ...).

    Raises:
        ValueError: for an unknown ``mode`` or ``loss_reduction``, a ``count_fn`` that is not callable, or a
            ``ddp_comm_hook`` in deferred mode.

    After each window, :attr:`last_window` holds a :class:`~token_mean.WindowStats` (N, this rank's n, the per-rank
    counts, the window length and the exact global mean loss), identical on every rank.

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
        count_fn: Callable[[Any], int | float | Tensor] | None = None,
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
        self._mode: Mode = mode
        self._pad_uneven_ranks = pad_uneven_ranks
        self._iterator: TrainIterator | None = None
        self._window: _Window | None = None
        self._micro_batch_scale: tuple[float | Tensor, bool | Tensor] = (1.0, True)
        self._last_provisional: float | None = None
        self.last_window: WindowStats | None = None
        self.skipped_steps = 0

    @property
    def count_fn(self) -> Callable[[Any], int | float | Tensor]:
        """The count of valid items of one micro-batch: the user's ``count_fn`` or the ``labels != -100`` default."""
        return self._count_fn or count_valid_labels

    @property
    def loss_reduction(self) -> LossReduction:
        return self._loss_reduction

    @property
    def mode(self) -> Mode:
        return self._mode

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
    # set-up
    # ------------------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                "`TokenMeanDDPStrategy` needs automatic optimization: with `automatic_optimization = False` the"
                " LightningModule calls backward itself and the strategy cannot normalize it. Divide the summed loss"
                " by the all-reduced count yourself, or set `self.automatic_optimization = True`."
            )
        if self.handles_gradient_accumulation:
            raise ValueError(
                f"`{type(self).__name__}` cannot normalize windows when `handles_gradient_accumulation` is True:"
                " the strategy would no longer see the accumulation windows."
            )
        for optimizer in self.optimizers:
            if isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.LBFGS):
                raise ValueError(
                    "`TokenMeanDDPStrategy` does not support `torch.optim.LBFGS`: it re-evaluates the closure"
                    " within one step, which would count the window's items again. Use a first-order optimizer."
                )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        # Identical on every rank. D only changes rounding, but restoring it keeps a resumed run bitwise identical.
        checkpoint[_CHECKPOINT_KEY] = {"skipped_steps": self.skipped_steps, "provisional": self._last_provisional}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # called on resume only (not for weights-only loading), on every rank
        super().load_optimizer_state_dict(checkpoint)
        state = checkpoint.get(_CHECKPOINT_KEY)
        if state is not None:
            self.skipped_steps = int(state["skipped_steps"])
            provisional = state["provisional"]
            self._last_provisional = None if provisional is None else float(provisional)

    @override
    def _register_ddp_hooks(self) -> None:
        super()._register_ddp_hooks()
        if self._mode == "deferred":
            assert isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
            # Folding D/N into the bucket all-reduce of the window's last backward costs no extra pass over the
            # gradients. Registered on every device type: Lightning only registers `ddp_comm_hook` on CUDA.
            self.model.register_comm_hook(self, scaled_allreduce_hook)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        if module is None or module._trainer is None or not module.trainer.training:
            return dataloader  # validation, test and predict loaders are used as they are
        length = self._common_length(dataloader)
        count = self._read_count if self._mode == "lookahead" else None
        distributed = self.world_size > 1 and dist.is_initialized()
        agree = self._agree if length is None and distributed and self._pad_uneven_ranks else None
        ranks = (self._gather_objects, self.global_rank) if distributed else None
        return wrap_loader(dataloader, count, self._on_iter, length, agree, ranks)

    def _gather_objects(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def _agree(self, has_batch: bool, unfillable: bool) -> tuple[bool, bool]:
        """OR two flags over the ranks: one tiny collective per batch, for unsized loaders only.

        Lightning itself broadcasts a flag every batch under DDP; this costs about as much, and it is what lets ranks
        whose streams end at different batches finish the epoch together.
        """
        flags = torch.tensor([int(has_batch), int(unfillable)], dtype=torch.int64, device=self.root_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_batch, any_unfillable = flags.tolist()
        return bool(any_batch), bool(any_unfillable)

    def _common_length(self, dataloader: object) -> int | None:
        """The longest rank's number of batches (one collective per epoch); None for a loader without a length."""
        local = sized_len(dataloader)
        if local is None or self.world_size == 1 or not dist.is_initialized():
            return local
        extremes = torch.tensor([local, -local], dtype=torch.int64, device=self.root_device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        longest, shortest = int(extremes[0]), -int(extremes[1])
        if longest != shortest and (shortest == 0 or not self._pad_uneven_ranks):
            raise ValueError(
                f"token_mean: the ranks' training loaders have between {shortest} and {longest} batches (this rank:"
                f" {local}). "
                + (
                    "A rank without any batch cannot take part in DDP's backward: give every rank at least one batch."
                    if shortest == 0
                    else "With `pad_uneven_ranks=False` every rank needs the same number: set `pad_uneven_ranks=True`"
                    " to let exhausted ranks contribute zero-weight batches, or balance the shards."
                )
            )
        return longest

    def _on_iter(self, iterator: TrainIterator) -> None:
        # a new epoch (or a resumed one): windows restart with the loader
        self._iterator = iterator
        self._window = None

    def _read_count(self, batch: Any) -> Count:
        """Count one batch as the loader yields it: (count, problem, detail). Never raises, see `_PROBLEMS`."""
        try:
            value, detail = check_count(self.count_fn(batch), "`count_fn`")
        except Exception as error:  # every rank must reach the collective to learn of it
            return 0.0, _COUNT_FAILED, f"`count_fn` raised {type(error).__name__}: {error}"
        if value is None:
            return 0.0, _COUNT_FAILED, detail
        # a host-side batch makes `.item()` free; a device-side one costs a sync per batch
        count = float(value.item()) if isinstance(value, Tensor) else value
        if not math.isfinite(count):
            return 0.0, _COUNT_NONFINITE, f"`count_fn` returned {count}"
        if count < 0:
            return 0.0, _COUNT_NEGATIVE, f"`count_fn` returned {count}"
        return count, None, ""

    # ------------------------------------------------------------------------------------------------------------
    # one micro-batch
    # ------------------------------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        trainer = self._trainer()
        epoch_loop = trainer.fit_loop.epoch_loop
        position = epoch_loop.batch_progress.current.ready - 1
        # Lightning's own stepping rule: K reached, or the last batch of the epoch
        steps_now = not epoch_loop._should_accumulate()
        count: float | Tensor = 0.0
        if self._mode == "lookahead":
            count = self._lookahead_count(trainer, position, steps_now)
        output = super().training_step(*args, **kwargs)
        window = self._window
        assert window is not None or self._mode == "deferred"
        loss, output = self._loss_of(output)
        if self._mode == "deferred":
            window = self._deferred_begin(position)
            entry = self._iterator.pop() if self._iterator is not None else None
            filler = entry is not None and entry.filler
            count = self._deferred_count(args[0] if args else kwargs.get("batch"), output, filler)
        assert window is not None
        if self._mode == "lookahead" and isinstance(output, Mapping) and output.get("num_items") is not None:
            assert isinstance(count, float)
            self._check_num_items(window, output["num_items"], count)
        self._add_loss(window, loss, count)
        window.trained += 1
        if steps_now:
            self._finish_window(trainer, window)
        elif self._mode == "lookahead" and window.trained == window.length:
            raise RuntimeError(
                f"token_mean: internal error: the lookahead window starting at batch {window.start} ended after"
                f" {window.length} micro-batches, but Lightning did not step. Please report this with your Trainer"
                " settings."
            )
        return output

    def _trainer(self) -> pl.Trainer:
        module = self.lightning_module
        assert module is not None
        return module.trainer

    def _loss_of(self, output: STEP_OUTPUT) -> tuple[Tensor | None, STEP_OUTPUT]:
        if isinstance(output, Tensor):
            return output, output
        if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
            return output["loss"], output
        # A stand-in loss keeps this rank in step until the window's collective, where every rank raises.
        stand_in = torch.zeros((), device=self.root_device, requires_grad=True)
        return None, ({**output, "loss": stand_in} if isinstance(output, Mapping) else stand_in)

    def _lookahead_count(self, trainer: pl.Trainer, position: int, steps_now: bool) -> float:
        window = self._window
        if window is None or window.trained == window.length:
            window = self._lookahead_begin(trainer, position)
        if steps_now != (window.trained == window.length - 1):
            raise RuntimeError(
                f"token_mean: internal error: Lightning steps at batch {position} but the lookahead window"
                f" {window.start}..{window.start + window.length - 1} does not end there. Please report this with your"
                " Trainer settings."
            )
        assert self._iterator is not None
        entry = self._iterator.pop()
        assert entry is not None
        count = entry.count[0]
        # the count for now: `backward` turns it into the scale once the window's N has arrived
        self._micro_batch_scale = (count, count > 0)
        return count

    def _check_num_items(self, window: _Window, num_items: Any, count: float) -> None:
        """A model that reports 'num_items' must agree with the count the lookahead already normalized by."""
        value = self._device_count(window, num_items, "'num_items'")
        if value is not None:
            self._flag_if(window, _COUNT_MISMATCH, value != count)

    def _lookahead_begin(self, trainer: pl.Trainer, position: int) -> _Window:
        if self._iterator is None:
            raise RuntimeError(
                "token_mean: the training loader was not wrapped for lookahead. `mode='lookahead'` reads the loader"
                " through `process_dataloader`; with a `training_step(self, dataloader_iter)` signature use"
                " `mode='deferred'`."
            )
        accumulate = trainer.accumulate_grad_batches
        length = accumulate - position % accumulate
        if math.isfinite(trainer.num_training_batches):
            length = min(length, int(trainer.num_training_batches) - position)
        entries = self._iterator.peek(length)
        window = _Window(start=position, length=len(entries))
        flags = [0.0] * len(_PROBLEMS)
        for entry in entries:
            _, problem, detail = entry.count
            if problem is not None:
                flags[problem] = 1.0
                window.problem_detail = window.problem_detail or detail
        local_count = math.fsum(entry.count[0] for entry in entries)
        record = torch.tensor([local_count, 0.0, float(window.length), *flags], dtype=torch.float64).to(
            self.root_device, non_blocking=True
        )
        # in flight during the first micro-batch's forward; awaited before its backward (see `_counts_of`)
        window.pending_counts = self._exchange(record, wait=False)
        window.loss_sum = torch.zeros((), dtype=torch.float64, device=self.root_device)
        window.flags = torch.zeros(len(_PROBLEMS), dtype=torch.float64, device=self.root_device)
        self._window = window
        return window

    def _counts_of(self, trainer: pl.Trainer, window: _Window) -> _Window:
        """Await the window's count gather (lookahead), raising on every rank before any backward that syncs."""
        if window.pending_counts is not None:
            rows, window.pending_counts = window.pending_counts(), None
            self._raise_if_problems(trainer, rows, window, check_lengths=True)
            window.rank_counts = tuple(row[_COUNT] for row in rows)
            window.global_count = math.fsum(window.rank_counts)
            # the loss scale that undoes Lightning's 1/K and DDP's 1/P
            window.grad_factor = self.world_size / window.global_count if window.global_count > 0 else 0.0
        return window

    def _deferred_begin(self, position: int) -> _Window:
        window = self._window
        if window is not None and window.trained < window.length:
            return window
        # the length is not known ahead in this mode; Lightning's stepping rule closes the window
        window = _Window(start=position, length=1 << 62)
        window.count = torch.zeros((), dtype=torch.float64, device=self.root_device)
        window.loss_sum = torch.zeros((), dtype=torch.float64, device=self.root_device)
        window.flags = torch.zeros(len(_PROBLEMS), dtype=torch.float64, device=self.root_device)
        self._window = window
        return window

    def _deferred_count(self, batch: Any, output: STEP_OUTPUT, filler: bool) -> Tensor:
        window = self._window
        assert window is not None and window.count is not None
        count = self._zero()  # a repeated batch of an exhausted rank: weight zero, whatever it holds
        if not filler:
            num_items = output.get("num_items") if isinstance(output, Mapping) else None
            reported = None if num_items is None else self._device_count(window, num_items, "'num_items'")
            from_fn = None
            if self._count_fn is not None or num_items is None:
                try:
                    from_fn = self._device_count(window, self.count_fn(batch), "`count_fn`")
                except Exception as error:  # every rank must reach the collective to learn of it
                    self._flag(window, _COUNT_FAILED, f"`count_fn` raised {type(error).__name__}: {error}")
            if reported is not None and from_fn is not None:
                self._flag_if(window, _COUNT_MISMATCH, reported != from_fn)
            chosen = reported if num_items is not None else from_fn  # 'num_items' takes precedence
            count = chosen if chosen is not None else count
        # negative and non-finite counts are flagged on the device: no host sync per micro-batch
        self._flag_if(window, _COUNT_NEGATIVE, count < 0)
        self._flag_if(window, _COUNT_NONFINITE, ~torch.isfinite(count))
        has_items = torch.isfinite(count) & (count > 0)
        count = torch.where(has_items, count, torch.zeros_like(count))
        window.count = window.count + count
        accumulate = self._trainer().accumulate_grad_batches
        if window.trained == 0:
            window.provisional = self._provisional(count, accumulate)
        # backward on this rank's loss sum over D; Lightning's 1/K is undone here
        items = count if self._loss_reduction == "mean" else torch.ones_like(count)
        self._micro_batch_scale = (items * (accumulate / window.provisional), has_items)
        return count

    def _device_count(self, window: _Window, value: Any, source: str) -> Tensor | None:
        """One count as a float64 scalar on the device; None (and a flag) when it is not a number."""
        count, detail = check_count(value, source)
        if count is None:
            self._flag(window, _COUNT_FAILED, detail)
            return None
        return torch.as_tensor(count, dtype=torch.float64).to(self.root_device, non_blocking=True)

    def _flag(self, window: _Window, problem: int, detail: str) -> None:
        assert window.flags is not None
        window.flags[problem] = 1.0
        window.problem_detail = window.problem_detail or detail

    @staticmethod
    def _flag_if(window: _Window, problem: int, condition: Tensor) -> None:
        """Raise a problem flag on the device, without reading the condition on the host."""
        assert window.flags is not None
        window.flags[problem] += condition.to(window.flags.dtype)

    def _zero(self) -> Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.root_device)

    def _add_loss(self, window: _Window, loss: Tensor | None, count: float | Tensor) -> None:
        assert window.loss_sum is not None and window.flags is not None
        if loss is None:
            window.flags[_NO_LOSS] = 1.0
            return
        value = loss.detach().to(torch.float64).reshape(())
        # A micro-batch without items may hold NaN (0/0): it contributes zero; with items, NaN is an error.
        if isinstance(count, float):  # lookahead: the count is on the host, so no copy and no select
            if count <= 0:
                return
            value = value * count if self._loss_reduction == "mean" else value
            self._flag_if(window, _BAD_LOSS, ~torch.isfinite(value))
            window.loss_sum = window.loss_sum + value
            return
        has_items = count > 0
        value = value * count if self._loss_reduction == "mean" else value
        self._flag_if(window, _BAD_LOSS, has_items & ~torch.isfinite(value))
        window.loss_sum = window.loss_sum + torch.where(has_items, value, torch.zeros_like(value))

    # ------------------------------------------------------------------------------------------------------------
    # the end of a window
    # ------------------------------------------------------------------------------------------------------------

    def _finish_window(self, trainer: pl.Trainer, window: _Window) -> None:
        assert window.loss_sum is not None and window.flags is not None
        window.length = window.trained
        if self._mode == "lookahead":
            self._counts_of(trainer, window)
            record = torch.cat([torch.stack([self._zero(), window.loss_sum, self._zero()]), window.flags])
        else:
            assert window.count is not None
            record = torch.cat(
                [torch.stack([window.count, window.loss_sum, self._zero() + window.length]), window.flags]
            )
        rows = self._exchange(record)
        self._raise_if_problems(trainer, rows, window, check_lengths=self._mode == "deferred")
        if self._mode == "deferred":
            window.rank_counts = tuple(row[_COUNT] for row in rows)
            window.global_count = math.fsum(window.rank_counts)
            # the buckets hold Σ∇(loss sums)/D on each rank; scaling by D/N before the SUM all-reduce gives 1/N
            window.grad_factor = window.provisional / window.global_count if window.global_count > 0 else 0.0
            if window.global_count > 0:
                self._last_provisional = window.global_count / self.world_size
        loss_total = math.fsum(row[_LOSS_SUM] for row in rows)
        skipped = window.global_count == 0
        rank = self.global_rank
        self.last_window = WindowStats(
            global_count=window.global_count,
            local_count=window.rank_counts[rank],
            rank_counts=window.rank_counts,
            window_length=window.length,
            loss=None if skipped else loss_total / window.global_count,
            skipped=skipped,
            mode=self._mode,
        )
        if skipped:
            self.skipped_steps += 1
        if skipped and self.skipped_steps == 1:
            rank_zero_warn(
                "token_mean: an accumulation window had no valid items on any rank (N = 0); its optimizer step was"
                " skipped, leaving parameters and optimizer state unchanged. `strategy.skipped_steps` counts them."
            )

    @overload
    def _exchange(self, record: Tensor) -> list[list[float]]: ...

    @overload
    def _exchange(self, record: Tensor, wait: Literal[False]) -> Callable[[], list[list[float]]]: ...

    def _exchange(self, record: Tensor, wait: bool = True) -> Any:
        """All-gather one small float64 record per rank; with ``wait=False``, a function that awaits it.

        Read on the host once awaited: the problem flags must reach every rank before DDP's backward of the window's
        last micro-batch, so that every rank raises together instead of one waiting in the gradient all-reduce. The
        time ranks wait here is mostly their imbalance, which plain DDP pays at that all-reduce instead.
        """
        if self.world_size == 1 or not dist.is_available() or not dist.is_initialized():
            rows = record.view(1, -1)
            return rows.tolist() if wait else rows.tolist
        # flat output: gloo rejects a (P, R) one
        flat = torch.empty(self.world_size * record.numel(), dtype=record.dtype, device=record.device)
        # torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases only have the old name
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(flat, record.contiguous(), async_op=not wait)

        def result() -> list[list[float]]:
            if work is not None:
                work.wait()
            return flat.view(self.world_size, -1).tolist()  # type: ignore[no-any-return]

        return result() if wait else result

    def _raise_if_problems(
        self, trainer: pl.Trainer, rows: list[list[float]], window: _Window, check_lengths: bool
    ) -> None:
        messages: list[str] = []
        for rank, row in enumerate(rows):
            for index, (what, fix) in enumerate(_PROBLEMS):
                if row[_FLAGS + index]:
                    messages.append(f"rank {rank}: {what}. Fix: {fix}")
        if check_lengths and len({row[_LENGTH] for row in rows}) > 1:
            lengths = ", ".join(f"rank {rank}: {int(row[_LENGTH])}" for rank, row in enumerate(rows))
            what, fix = _PROBLEMS[_UNEVEN]
            messages.append(f"{what} ({lengths} micro-batches). Fix: {fix}")
        if not messages:
            return
        last = window.start + max(window.length, window.trained) - 1
        error = DenominatorError(
            f"token_mean: cannot normalize the accumulation window of optimizer step {trainer.global_step + 1}"
            f" (epoch {trainer.current_epoch}, batches {window.start}..{last}):\n  " + "\n  ".join(messages)
        )
        if window.problem_detail:  # a note, so that the message itself is the same on every rank
            error.add_note(f"On rank {self.global_rank}: {window.problem_detail}")
        raise error

    # ------------------------------------------------------------------------------------------------------------
    # backward and step
    # ------------------------------------------------------------------------------------------------------------

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        scale, has_items = self._micro_batch_scale
        if isinstance(has_items, Tensor):  # deferred: the count lives on the device, so select without a sync
            closure_loss = torch.where(has_items, closure_loss, torch.zeros_like(closure_loss)) * scale
        elif has_items:
            assert self._window is not None
            trainer = self._trainer()
            factor = self._counts_of(trainer, self._window).grad_factor * trainer.accumulate_grad_batches
            closure_loss = closure_loss * (factor * scale if self._loss_reduction == "mean" else factor)
        else:
            # the mean of an empty micro-batch is 0/0 = NaN; its backward must still run for DDP
            if self._window is not None:
                self._counts_of(self._trainer(), self._window)  # a bad count raises here, before any synced backward
            closure_loss = torch.nan_to_num(closure_loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _provisional(self, first_count: Tensor, accumulate: int) -> float:
        """D, this rank's stand-in for N/P until N is known: the previous window's N/P.

        Backward on raw loss sums would overflow fp16 at GradScaler's default scale of 2**16; sums over D have the
        magnitude of a mean. Any D is exact, since the gradient hook multiplies by D/N.
        """
        if self._last_provisional is not None:
            return self._last_provisional
        # first window only: one host sync to size D from the first micro-batch
        return max(float(first_count.item()) * accumulate, 1.0)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        # Run the window's last micro-batch first: afterwards N is known, so an empty window can skip the step, and
        # in deferred mode the gradient is final before AMP's unscale, `on_before_optimizer_step` and clipping.
        result = closure()
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

        if self.last_window is not None and self.last_window.skipped:
            return None
        return super().optimizer_step(optimizer, replay, model, **kwargs)


TokenMeanDDPStrategy.register_strategies(StrategyRegistry)
