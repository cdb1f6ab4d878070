"""``TokenMeanAccumulator``: the exact token mean in a hand-written Lightning Fabric loop (LitGPT's shape).

A Fabric loop that accumulates ``fabric.backward(loss / K)`` over K micro-batches optimizes a mean of means, as the
Trainer does. The accumulator drives the same modes, reader and window record as the Trainer strategies; the loop
changes in five lines:

.. code-block:: python

    accumulator = TokenMeanAccumulator(fabric, model, accumulate=K, count_fn=count_shifted_labels)
    for batch in accumulator.batches(train_dataloader):       # every rank yields as many (fillers: is_filler)
        with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
            logits = model(batch["input_ids"])
            loss = chunked_cross_entropy(logits[..., :-1, :], batch["labels"][..., 1:])
            accumulator.backward(loss)                          # instead of fabric.backward(loss / K)
        if not accumulator.accumulating:
            stats = accumulator.finish()                        # DenominatorError on every rank; gradient final
            if not stats.skipped:                               # N == 0 on every rank: no update
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
            optimizer.zero_grad()

Supported strategies: one device, ``DDPStrategy`` (every launcher, ``torchrun`` too) and ``ModelParallelStrategy``
(FSDP2 and tensor parallelism over Fabric's ``("data_parallel", "tensor_parallel")`` mesh, the count reduced over the
data-parallel ranks and checked to agree over the tensor-parallel ones). FSDP1 (``FSDPStrategy``) and DeepSpeed are
refused: FSDP1 needs a GPU this package is not tested on, and Fabric's ``no_backward_sync`` does nothing under
DeepSpeed.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import IterableDataset

from token_mean import _lightning, _torch
from token_mean._audit import Audit, AuditSchedule, FabricAuditing, OnAuditFailure
from token_mean._core import Layout, checked_settings, make_mode
from token_mean._counting import CountFn
from token_mean._counts import count_valid_labels
from token_mean._ddp import InReduction, ShadowBackward, UnreducedParameters
from token_mean._exit import destroy_process_group_at_exit
from token_mean._filler import mark_filler_batch
from token_mean._fingerprint import global_norm, grad_norm
from token_mean._fsdp import AfterReduction, check_reduction, mesh_world
from token_mean._loaders import agree_on_length
from token_mean._mode import LossReduction, Mode, StepOutput, WindowMode
from token_mean._observe import MonitorSettings, Observer, OnDivergence
from token_mean._progress import Progress
from token_mean._reader import Reader
from token_mean._record import World
from token_mean._window import WindowStats


@dataclass
class _InFlight:
    """The micro-batch the loop is training, and what the loop has done with it (misuse is an error)."""

    position: int
    last: bool  # its window's last: the gradient is reduced in its backward
    filler: bool
    batch: Any
    backward_done: bool = False
    finished: bool = False

    @staticmethod
    def of(flight: _InFlight | None, what: str) -> _InFlight:
        if flight is None:
            raise RuntimeError(f"{what} is only defined for a batch that `accumulator.batches(...)` yielded.")
        return flight

    def backward(self) -> None:
        if self.backward_done:
            raise RuntimeError(
                f"`accumulator.backward(loss)` was called twice for batch {self.position}: its items would count"
                " twice. Call it once per batch."
            )

    def finish(self) -> None:
        if not self.last or not self.backward_done or self.finished:
            state = "is called twice" if self.finished else "comes before the window's last backward"
            raise RuntimeError(
                f"`accumulator.finish()` {state} (batch {self.position}): call it once per window, after"
                " `accumulator.backward(loss)` of the batch where `accumulator.accumulating` is False."
            )

    def done(self) -> None:
        """The loop asks for the next batch: this one must have run its backward (and finished its window)."""
        if not self.backward_done:
            raise RuntimeError(
                f"`accumulator.backward(loss)` was not called for batch {self.position}: every batch the"
                " accumulator yields must run its backward (a filler's too), or the ranks fall out of step."
            )
        if self.last and not self.finished:
            raise RuntimeError(
                f"`accumulator.finish()` was not called after the last micro-batch of the window ending at batch"
                f" {self.position}: call it when `accumulator.accumulating` is False, before the optimizer step."
            )

    def left(self, accumulate: int) -> tuple[int | None, int | None]:
        """The loop left the pass at this batch: ``(position to resume at, None)`` at a window boundary (its window
        finished, or this batch opens a window and ran no backward), else ``(None, this position)``."""
        if self.finished:
            return self.position + 1, None
        if not self.backward_done and self.position % accumulate == 0:  # windows are K apart from the pass's start
            return self.position, None
        return None, self.position

    def saved(self) -> None:
        if not self.finished:
            raise RuntimeError(
                "`accumulator.state_dict()` in the middle of a window: its partial gradient is not saved. Save after"
                " `accumulator.finish()` and the optimizer step."
            )

    def check_sync(self, flags: Sequence[bool]) -> None:
        """The model reduces the gradient in the window's last backward, and only there (host-side flags)."""
        if flags and set(flags) != {self.last}:
            wrong = "would not reduce the window's gradient" if self.last else "would reduce it mid-window"
            raise RuntimeError(
                f"The gradient sync of batch {self.position} disagrees with the window: its backward {wrong}. Wrap"
                " each micro-batch's forward and backward in `with fabric.no_backward_sync(model,"
                " enabled=accumulator.accumulating):`."
            )


class TokenMeanAccumulator:
    r"""Accumulate K micro-batches per rank into one exact token-mean gradient, in a Lightning Fabric loop.

    Each window of K micro-batches per rank (the last window of a pass may be short) is normalized by its own N, the
    valid items over all ranks and micro-batches of the window, exactly as the Trainer strategies do: the same modes,
    counts, checks and errors (see :class:`~token_mean.TokenMeanDDPStrategy`), one collective per window and no host
    read between the window's first forward and its last backward. Every rank yields as many batches: a rank whose
    loader runs out repeats its last batch at weight zero (:attr:`is_filler`). Strategies: see the module docstring.

    Args:
        fabric: the launched ``Fabric``.
        model: what ``fabric.setup`` (or ``setup_module``) returned.
        accumulate: K, the micro-batches per rank and window.
        count_fn, loss_reduction, mode, pad_uneven_ranks: as for :class:`~token_mean.TokenMeanDDPStrategy`;
            ``loss_reduction`` describes the loss passed to :meth:`backward`.
        monitor: a :class:`FabricMonitor` that logs every window (``fabric.log_dict``) and writes or compares a trace.

    Raises:
        ValueError: for a bad setting, a model that ``fabric.setup`` did not return, or an unsupported strategy.

    Example:
        >>> from lightning.fabric import Fabric
        >>> fabric = Fabric(accelerator="cpu", devices=1)
        >>> model = fabric.setup(torch.nn.Linear(4, 3))
        >>> accumulator = TokenMeanAccumulator(fabric, model, accumulate=2)
        >>> batches = [{"x": torch.randn(2, 4), "labels": torch.tensor([0, -100])} for _ in range(3)]
        >>> for batch in accumulator.batches(batches):
        ...     loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"], ignore_index=-100)
        ...     accumulator.backward(loss)
        ...     if not accumulator.accumulating:
        ...         stats = accumulator.finish()
        >>> stats.global_count, stats.window_length  # the short last window: one micro-batch, one valid label
        (1.0, 1)
    """

    def __init__(
        self,
        fabric: Any,
        model: Any,
        accumulate: int,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction = "mean",
        mode: Mode = "lookahead",
        pad_uneven_ranks: bool = True,
        monitor: FabricMonitor | None = None,
    ) -> None:
        self._settings, mode_name = checked_settings(count_fn, loss_reduction, mode, pad_uneven_ranks)
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"`accumulate` must be a positive int (micro-batches per window), got {accumulate!r}.")
        modules = _lightning.fabric_modules(model)
        if modules is None or _lightning.fabric_strategy_of(model) is not fabric.strategy:
            raise ValueError(
                f"`model` must be what `fabric.setup(model)` (or `fabric.setup_module`) returned for this Fabric, got"
                f" {type(model).__name__}: the accumulator hooks into the module the strategy wrapped."
            )
        self._fabric = fabric
        self._model = model
        self._accumulate = accumulate
        layout, self._sync_flags = _layout(fabric, *modules)
        self._mode: WindowMode = make_mode(mode_name, layout, self._settings, rank_counts=monitor is not None)
        if layout.world.distributed:
            destroy_process_group_at_exit()
        self._monitor = monitor
        if monitor is not None:  # the audit counts as the accumulator does
            monitor.auditing.attach(model, self._settings.count_fn, loss_reduction, aux=mode_name == "lookahead")
        self._in_flight: _InFlight | None = None
        self._iterating = False
        self._progress = Progress(layout.world.size)
        self._last_window: WindowStats | None = None

    @property
    def accumulating(self) -> bool:
        """True while the batch in flight is not its window's last (its gradient must not be reduced yet)."""
        return not _InFlight.of(self._in_flight, "`accumulating`").last

    @property
    def is_filler(self) -> bool:
        """True while the batch in flight is a zero-weight repeat of an exhausted rank."""
        return _InFlight.of(self._in_flight, "`is_filler`").filler

    @property
    def last_window(self) -> WindowStats | None:
        """What the last finished window used (None before the first)."""
        return self._last_window

    @property
    def skipped_steps(self) -> int:
        """Windows that had no valid item on any rank (``finish().skipped``)."""
        return self._mode.skipped_steps

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """One pass over ``iterable`` (what ``fabric.setup_dataloaders`` returned, or any iterable of batches): every
        rank yields as many batches. A sized iterable costs one collective at the pass's start (the ranks agree on its
        length); a stream's end is agreed window by window."""
        if self._iterating:
            raise RuntimeError("`accumulator.batches(...)` is already being iterated: one pass at a time.")
        return self._pass(iterable)

    def _pass(self, iterable: Iterable[Any]) -> Iterator[Any]:
        if self._iterating:  # two passes made before either started (`zip`)
            raise RuntimeError("`accumulator.batches(...)` is already being iterated: one pass at a time.")
        self._iterating = True
        completed = False
        try:
            start, epoch = self._progress.start_pass()
            reader, move, loader_pass = _reader(iterable, start, epoch, self._mode, self._settings.pad_uneven_ranks)
            self._progress.reading(loader_pass)
            _refuse_partial_gradient(self._progress.take_abandoned(), self._model)
            self._mode.start_epoch(reader)
            if self._monitor is not None:
                self._monitor.start(self._fabric)
            for position in itertools.count(start):
                self._check_previous_batch()
                try:
                    item = reader.next_item()
                except StopIteration:
                    completed = True
                    break
                last = (position + 1) % self._accumulate == 0 or position + 1 >= reader.length
                step = f"optimizer step {self._progress.windows} (pass {self._progress.passes}"  # 0-based, as traces
                filler = self._mode.begin(position, last, self._accumulate, step)
                self._in_flight = _InFlight(position, last, filler, move(item[0]))
                if self._monitor is not None:
                    self._monitor.auditing.micro_batch(self._model, self._in_flight.batch, filler)
                mark_filler_batch(filler)  # until its backward: the loop's other code (validation) is not the filler
                yield self._in_flight.batch
        finally:
            self._iterating = False
            mark_filler_batch(False)
            flight, self._in_flight = self._in_flight, None
            self._progress.left(*_where_left(flight, completed, self._accumulate, self._model))
            if self._monitor is not None:
                self._monitor.stepped(self._model)

    def _check_previous_batch(self) -> None:
        flight = self._in_flight
        if flight is not None:
            flight.done()
            if flight.last and self._monitor is not None:
                self._monitor.stepped(self._model)

    def backward(self, loss: Tensor, *args: Any, aux_loss: Tensor | None = None, num_items: Any = None,
                 **kwargs: Any) -> None:
        """Back-propagate the micro-batch's ``loss`` (its mean over its valid items, or their sum), scaled for the
        window's exact token mean, through ``fabric.backward`` (``args`` and ``kwargs`` go there too).

        ``aux_loss``: an auxiliary term averaged over the window's real micro-batches on all ranks (lookahead only);
        ``num_items``: this micro-batch's count as the model computed it (checked against ``count_fn``; deferred
        mode normalizes by it).
        """
        flight = _InFlight.of(self._in_flight, "`accumulator.backward(loss)`")
        flight.backward()
        flight.check_sync(self._sync_flags())
        self._mode.after_forward(flight.batch, StepOutput(loss, aux_loss, num_items, loss))
        scaled = self._mode.scale(loss, 1.0, aux_loss)
        self._fabric.backward(scaled, *args, model=self._model, **kwargs)
        flight.backward_done = True
        mark_filler_batch(False)
        if not flight.last:
            self._mode.after_backward()

    def finish(self) -> WindowStats:
        """After the window's last backward: its stats (the window's one host read). The gradient is then the
        window's exact token mean; every rank raises the same :class:`~token_mean.DenominatorError` here if any rank
        had a problem. A window with N = 0 on every rank is ``skipped``: do not step the optimizer for it."""
        flight = _InFlight.of(self._in_flight, "`accumulator.finish()`")
        flight.finish()
        ended = self._mode.after_backward()
        assert ended is not None  # the window's last backward ran
        flight.finished = True
        self._progress.windows += 1
        stats = ended.stats if self._monitor is None else self._monitor.finished(self._model, ended.stats)
        self._last_window = stats
        return stats

    def state_dict(self) -> dict[str, Any]:
        """What resuming at a window boundary needs (identical on every rank): save it with the model and optimizer.

        Raises:
            RuntimeError: in the middle of a window (Fabric saves no partial gradient): save after ``finish()``.
        """
        flight = self._in_flight
        if flight is not None:
            flight.saved()
        return {"mode": self._mode.state_dict(),
                **self._progress.state_dict(None if flight is None else flight.position + 1)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``batches(...)`` skips the batches the saved pass had trained (the loader must yield
        them in the same order; a loader from ``fabric.setup_dataloaders`` gets its saved pass counter back, the
        epoch its sampler orders by).

        Raises:
            ValueError: for a checkpoint written in the middle of a pass by another number of processes.
        """
        self._progress.load_state_dict(state)
        self._mode.load_state_dict(state["mode"])
        if self._monitor is not None:
            self._monitor.resume_at(self._progress.windows)


class FabricMonitor:
    """Log every window of a :class:`TokenMeanAccumulator` and write or compare its trace, as
    :class:`~token_mean.DenominatorMonitor` does under the Trainer (the same metrics, trace columns and comparison).

    Metrics go through ``fabric.log_dict`` from rank zero under the window's step (windows finished before it), every
    ``logging_interval`` windows; ``grad_norm`` is taken in ``finish()`` (before clipping), ``param_norm`` after the
    optimizer step (when the loop asks for the next batch).

    With ``audit_every``, ``finish()`` audits the first window and every N-th after it (``docs/audit.md``) and puts
    the figure on its ``WindowStats.audit_error``. A loop without the accumulator (LitGPT's ``fabric.backward(loss
    / K)``) is audited by calling :meth:`micro_batch` before each micro-batch's forward and :meth:`audit` after
    the window's last backward, before clipping and the step.

    Args:
        logging_interval: log every this many windows.
        prefix, record, reference, rtol, atol, on_divergence: as for :class:`~token_mean.DenominatorMonitor`.
        audit_every, on_audit_failure, audit_tolerance: as for :class:`~token_mean.DenominatorMonitor`.
        audit_loss: ``fn(model, batch) -> loss``, the micro-batch's loss exactly as the loop computes it, on the
            unwrapped module (the audit replays it; required with ``audit_every``).
        count_fn, loss_reduction: the audit's count and what ``audit_loss`` returns, in a loop without the
            accumulator (with one, the accumulator's).
    """

    def __init__(
        self,
        logging_interval: int = 1,
        prefix: str = "denominator",
        record: Any = None,
        reference: Any = None,
        rtol: float = 1e-4,
        atol: float = 1e-6,
        on_divergence: OnDivergence = "warn",
        audit_every: int | None = None,
        audit_loss: Callable[[Any, Any], Any] | None = None,
        on_audit_failure: OnAuditFailure = "warn",
        audit_tolerance: float | None = None,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction = "mean",
    ) -> None:
        settings = MonitorSettings.checked(
            logging_interval, prefix, record, reference, rtol, atol, on_divergence, "every window (1)", "FabricMonitor"
        )
        schedule = AuditSchedule(audit_every, on_audit_failure, audit_tolerance)
        self.auditing = FabricAuditing(schedule, audit_loss, count_fn or count_valid_labels, loss_reduction)
        self._interval = logging_interval
        self._observer = Observer(settings)
        self._fabric: Any = None
        self._step = 0  # windows logged
        self._pending: tuple[WindowStats, float, Tensor | None] | None = None  # finished, its step not yet taken
        self._started_at = time.perf_counter()
        self._started = False

    @property
    def first_divergence(self) -> Any:
        """The first divergent window (set on every rank), ``None`` if none or no reference."""
        return self._observer.first_divergence

    def resume_at(self, step: int) -> None:
        """A resumed run (``accumulator.load_state_dict``): its windows are numbered on from the checkpoint's, as in
        the uninterrupted run's trace."""
        self._step = step

    def start(self, fabric: Any) -> None:
        """A pass starts (the first one opens the trace)."""
        self._fabric = fabric
        if not self._started:
            self._observer.start(fabric.global_rank == 0, self._step, float("inf"))
            self._started = True
        self._started_at = time.perf_counter()

    @property
    def audits(self) -> list[Audit]:
        """Every audited window so far, in order."""
        return self.auditing.auditor.audits

    def micro_batch(self, model: Any, batch: Any) -> None:
        """In a loop without the accumulator: a micro-batch's forward is about to run."""
        self.auditing.micro_batch(model, batch)

    def audit(self, model: Any) -> Audit | None:
        """In a loop without the accumulator: the window's last backward is done; its audit (None if not audited)."""
        return self.auditing.audit(model)

    def finished(self, model: Any, stats: WindowStats) -> WindowStats:
        """A window ended (``accumulator.finish()``): its audit and gradient norm now, before clipping."""
        audit = self.auditing.audit(model, _ACCUMULATED_UNSEEN)
        if audit is not None:
            stats = replace(stats, audit_error=audit.error)
        gradient = grad_norm(model, self._fabric.device) if self._observer.fingerprints else None
        self._pending = (stats, time.perf_counter() - self._started_at, gradient)
        return stats

    def stepped(self, model: Any) -> None:
        """The loop came back for a batch after a finished window: its update is done."""
        if self._pending is None:
            return
        (stats, elapsed, gradient), self._pending = self._pending, None
        param_norm = None
        if self._observer.fingerprints:
            param_norm = global_norm([p.detach() for p in model.parameters()], self._fabric.device)
        metrics, divergent = self._observer.window(self._step, stats, elapsed, (gradient, param_norm),
                                                   audit_error=stats.audit_error)
        log_now = (self._step + 1) % self._interval == 0 or divergent or stats.audit_error is not None
        if log_now and self._fabric.global_rank == 0:
            self._fabric.log_dict(metrics, step=self._step)
        self._step += 1
        self._started_at = time.perf_counter()

    def close(self) -> None:
        """Close the trace file (at the end of training)."""
        self._observer.close()


_ACCUMULATED_UNSEEN = (
    "gradient hooks on parameters or modules; an `audit_loss` that is not the loss passed to `accumulator.backward`;"
    " parameters DDP does not reduce; anything the loop does to `.grad` between the backward and `finish()`"
)

SyncFlags = Callable[[], Sequence[bool]]
"""The gradient-sync flags the next backward will use, read on the host (none: nothing reduces)."""


def _layout(fabric: Any, forward: Any, original: Any) -> tuple[Layout, SyncFlags]:
    """The core's view of Fabric's strategy, and how to read its gradient-sync flags."""
    from lightning.fabric.strategies.ddp import DDPStrategy
    from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy
    from lightning.fabric.strategies.fsdp import FSDPStrategy
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
    from lightning.fabric.strategies.single_device import SingleDeviceStrategy

    strategy, device = fabric.strategy, fabric.device
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):  # before DDP: DeepSpeed's strategy derives from it
        why = ("FSDP1 needs a GPU, where this package is not tested: use `ModelParallelStrategy` (FSDP2)"
               if isinstance(strategy, FSDPStrategy) else "Fabric's `no_backward_sync` does nothing under DeepSpeed")
        raise ValueError(f"`TokenMeanAccumulator` does not support `{type(strategy).__name__}`: {why}.")
    if isinstance(strategy, SingleDeviceStrategy):
        return Layout(World.single(device), lambda: AfterReduction(original, 1)), lambda: ()
    if isinstance(strategy, DDPStrategy):
        assert isinstance(forward, torch.nn.parallel.DistributedDataParallel)  # Fabric's DDP wraps the module
        distributed = dist.is_available() and dist.is_initialized() and fabric.world_size > 1
        world = World(fabric.world_size, fabric.global_rank, device, distributed=distributed)
        layout = Layout(world, lambda: InReduction(forward), [UnreducedParameters(forward)], ShadowBackward(forward))
        return layout, lambda: (forward.require_forward_param_sync,)  # what the forward prepared the backward for
    if isinstance(strategy, ModelParallelStrategy):
        world = mesh_world(strategy.device_mesh, device)
        check_reduction(forward, world.size, "TokenMeanAccumulator")
        layout = Layout(world, lambda: AfterReduction(forward, world.size))
        return layout, lambda: _torch.fsdp_reduces_gradients(forward)  # read by FSDP2 as the backward runs
    raise ValueError(
        f"`TokenMeanAccumulator` does not support `{type(strategy).__name__}`: use one device, `DDPStrategy` or"
        " `ModelParallelStrategy`."
    )


def _reader(
    iterable: Iterable[Any], start: int, epoch: int | None, mode: WindowMode, pad_uneven_ranks: bool
) -> tuple[Reader, Callable[[Any], Any], int | None]:
    """A pass's reader over ``iterable`` from position ``start`` (a resumed pass skips the batches trained before),
    what moves a batch to the device as the loop takes it, and the pass counter of a Fabric loader (its sampler's
    epoch; ``epoch`` restores a saved one): the ranks agree on the pass's length first (one collective; a stream's
    end is agreed window by window).

    Lookahead reads a window ahead: from a Fabric loader that moves batches to the device, it reads the host batches
    beneath it, counts them there (a count of a device batch would be a host read inside the window), and moves each
    batch as the loop takes it, as the loader would.
    """
    local = None if isinstance(getattr(iterable, "dataset", None), IterableDataset) else _length(iterable)
    length = agree_on_length(mode.channel, local, pad_uneven_ranks)
    loader_pass = _lightning.fabric_loader_pass(iterable, epoch)
    move: Callable[[Any], Any] = _unchanged
    if mode.name == "lookahead":
        host = _lightning.fabric_host_batches(iterable)
        if host is not None:
            iterable, move = host
    iterator = iter(iterable)
    last, following = _skip(iterator, start)
    reader = Reader(lambda: (next(following),), None, lambda: start)
    if last is not None:  # this rank had run out: its last batch is repeated at weight zero
        reader.adopt([(last,)])
    reader.start_epoch(length, resumed_exhausted=last is not None)
    return reader, move, loader_pass


Gradients = list[tuple["weakref.ref[Tensor]", int]]
"""The parameters' gradients, weakly (one set to None since is freed), each with its version counter."""


def _where_left(
    flight: _InFlight | None, completed: bool, accumulate: int, model: Any
) -> tuple[int | None, int | None, Gradients | None]:
    """How a pass ended (``Progress.left``): its loader ran out, or the loop left it at a window boundary (where it
    stopped) or inside a window (there, with the partial gradient the parameters hold)."""
    if flight is None or completed:
        return None, None, None
    stopped, inside = flight.left(accumulate)
    if inside is None:
        return stopped, None, None
    gradients = [grad for p in model.parameters() if (grad := p.grad) is not None]
    return None, inside, [(weakref.ref(grad), _torch.version(grad)) for grad in gradients]


def _refuse_partial_gradient(abandoned: tuple[int, Gradients] | None, model: Any) -> None:
    """The last pass ended inside a window: its partial gradient must not go into the next window's update. A
    gradient set to None or zeroed in place since (``zero_grad(set_to_none=False)``) is no partial window: judged by
    version counters, the same on every rank that ran the same loop (a look at the values would not be: a rank of
    fillers holds zeros). FSDP2 holds the partial gradient unsharded, out of the user's reach: it is dropped."""
    if abandoned is None:
        return
    position, gradients = abandoned
    current = {id(grad): grad for p in model.parameters() if (grad := p.grad) is not None}
    alive: list[tuple[Tensor, int]] = [(grad, version) for ref, version in gradients if (grad := ref()) is not None]
    if any(current.get(id(grad)) is grad and _torch.version(grad) == version for grad, version in alive):
        raise RuntimeError(
            f"The last pass of `accumulator.batches(...)` ended inside a window (after batch {position}): its"
            " partial gradient is still in the parameters' `.grad` and would go into the next update. Call"
            " `optimizer.zero_grad()` before the next pass, or leave passes at a window boundary."
        )
    _torch.drop_fsdp_unreduced_gradients(model)  # FSDP2 keeps the window's partial gradient where no zero_grad goes


def _unchanged(batch: Any) -> Any:
    return batch


def _length(iterable: Iterable[Any]) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def _skip(iterator: Iterator[Any], count: int) -> tuple[Any | None, Iterator[Any]]:
    """Skip ``count`` items: ``(the last item, iterator)`` when the iterator ran out by then (the item a filler
    repeats), else ``(None, the items after them)``."""
    last = None
    for _ in range(count):
        try:
            last = next(iterator)
        except StopIteration:
            return last, iterator
    if count == 0:
        return None, iterator
    try:
        following = next(iterator)
    except StopIteration:
        return last, iterator  # it ends exactly where the checkpoint was written
    return None, itertools.chain([following], iterator)


__all__ = ["FabricMonitor", "TokenMeanAccumulator"]
