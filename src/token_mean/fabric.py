"""``TokenMeanAccumulator``: the exact token mean in a hand-written Lightning Fabric loop (LitGPT's or torchtitan's).

A Fabric loop that accumulates ``fabric.backward(loss / K)`` over K micro-batches optimizes a mean of means, as the
Trainer does. The accumulator drives the same modes, reader and window record as the Trainer strategies; the loop
changes in five lines:

.. code-block:: python

    accumulator = TokenMeanAccumulator(fabric, model, accumulate=K, count_fn=count_shifted_labels)
    for batch in accumulator.batches(train_dataloader):       # every rank yields as many (fillers: is_filler_batch)
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

Or in torchtitan's shape, one window at a time, over the very same pass (the same batches, checks and errors; each
window's iteration ends with its last batch, and ``window.finish()`` is ``accumulator.finish()``):

.. code-block:: python

    for window in accumulator.windows(train_dataloader):      # K batches each (a sized pass's last may be short)
        for batch in window:
            with fabric.no_backward_sync(model, enabled=window.accumulating):
                logits = model(batch["input_ids"])
                accumulator.backward(chunked_cross_entropy(logits[..., :-1, :], batch["labels"][..., 1:]))
        stats = window.finish()
        if not stats.skipped:
            optimizer.step()
        optimizer.zero_grad()

Supported strategies: one device, ``DDPStrategy`` (every launcher, ``torchrun`` too) and ``ModelParallelStrategy``
(FSDP2 and tensor parallelism over Fabric's ``("data_parallel", "tensor_parallel")`` mesh, the count reduced over the
data-parallel ranks and checked to agree over the tensor-parallel ones). FSDP1 (``FSDPStrategy``) and DeepSpeed are
refused: FSDP1 needs a GPU this package is not tested on, and Fabric's ``no_backward_sync`` does nothing under
DeepSpeed.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

from torch import Tensor
from torch.utils.data import IterableDataset

from token_mean import _ddp, _fsdp, _lightning, _torch
from token_mean._core import Layout, checked_settings, make_mode
from token_mean._counting import CountFn
from token_mean._epoch import Epoch, Epochs
from token_mean._exit import destroy_process_group_at_exit
from token_mean._mode import LossReduction, MicroBatch, Mode, StepOutput
from token_mean._progress import Progress
from token_mean._reader import Reader
from token_mean._record import World
from token_mean.fabric_monitor import FabricMonitor
from token_mean.results import WindowStats


class _InFlight:
    """The micro-batch the loop is training (the core's), the batch it gave the loop, and whether the loop finished
    its window (misuse is an error)."""

    def __init__(self, micro: MicroBatch, batch: Any) -> None:
        self.micro = micro
        self.batch = batch
        self.finished = False

    @staticmethod
    def of(flight: _InFlight | None, what: str) -> _InFlight:
        if flight is None:
            raise RuntimeError(f"{what} is only defined for a batch that `accumulator.batches(...)` yielded.")
        return flight

    def backward(self) -> None:
        if self.micro.backward_ran:
            raise RuntimeError(
                f"`accumulator.backward(loss)` was called twice for batch {self.micro.position}: its items would count"
                " twice. Call it once per batch."
            )

    def finish(self) -> None:
        if not self.micro.last or not self.micro.backward_ran or self.finished:
            state = "is called twice" if self.finished else "comes before the window's last backward"
            raise RuntimeError(
                f"`accumulator.finish()` {state} (batch {self.micro.position}): call it once per window, after"
                " `accumulator.backward(loss)` of the batch where `accumulator.accumulating` is False."
            )

    def done(self) -> None:
        """The loop asks for the next batch: this one must have run its backward (and finished its window)."""
        if not self.micro.backward_ran:
            raise RuntimeError(
                f"`accumulator.backward(loss)` was not called for batch {self.micro.position}: every batch the"
                " accumulator yields must run its backward (a filler's too), or the ranks fall out of step."
            )
        if self.micro.last and not self.finished:
            raise RuntimeError(
                f"`accumulator.finish()` was not called after the last micro-batch of the window ending at batch"
                f" {self.micro.position}: call it when `accumulator.accumulating` is False, before the optimizer step."
            )

    def window_left(self) -> None:
        """The loop finishes a window of ``windows(...)`` or asks for the next: the window yielded its last batch (a
        break out of ``for batch in window:`` would leave the rest of its batches to the next window)."""
        if not self.micro.last:
            raise RuntimeError(
                f"A window of `accumulator.windows(...)` was finished or left at batch {self.micro.position}, before"
                " its last micro-batch: iterate each window to its end (`for batch in window:` without `break`), then"
                " call `window.finish()`."
            )

    def left(self, accumulate: int) -> tuple[int | None, int | None]:
        """The loop left the pass at this batch: ``(position to resume at, None)`` at a window boundary (its window
        finished, or this batch opens a window and ran no backward), else ``(None, this position)``."""
        position = self.micro.position
        if self.finished:
            return position + 1, None
        if not self.micro.backward_ran and position % accumulate == 0:  # windows are K apart from the pass's start
            return position, None
        return None, position

    def saved(self) -> None:
        if not self.finished:
            raise RuntimeError(
                "`accumulator.state_dict()` in the middle of a window: its partial gradient is not saved. Save after"
                " `accumulator.finish()` and the optimizer step."
            )

    def check_sync(self, flags: Sequence[bool]) -> None:
        """The model reduces the gradient in the window's last backward, and only there (host-side flags)."""
        last = self.micro.last
        if flags and set(flags) != {last}:
            wrong = "would not reduce the window's gradient" if last else "would reduce it mid-window"
            raise RuntimeError(
                f"The gradient sync of batch {self.micro.position} disagrees with the window: its backward {wrong}."
                " Wrap each micro-batch's forward and backward in `with fabric.no_backward_sync(model,"
                " enabled=accumulator.accumulating):`."
            )


class TokenMeanAccumulator:
    r"""Accumulate K micro-batches per rank into one exact token-mean gradient, in a Lightning Fabric loop.

    Each window of K micro-batches per rank (the last window of a pass may be short) is normalized by its own N, the
    valid items over all ranks and micro-batches of the window, exactly as the Trainer strategies do: the same modes,
    counts, checks and errors (see :class:`~token_mean.TokenMeanDDPStrategy`), one collective per window and no host
    read between the window's first forward and its last backward. Every rank yields as many batches: a rank whose
    loader runs out repeats its last batch at weight zero (:attr:`is_filler_batch`). Strategies: see the module
    docstring.

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
        >>> import torch
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

    def __init__(self, fabric: Any, model: Any, accumulate: int, count_fn: CountFn | None = None,
                 loss_reduction: LossReduction = "mean", mode: Mode = "lookahead", pad_uneven_ranks: bool = True,
                 monitor: FabricMonitor | None = None) -> None:
        settings, mode_name = checked_settings(count_fn, loss_reduction, mode, pad_uneven_ranks)
        self._layout = _layout(fabric, *_checked_model(fabric, model, accumulate))
        self._fabric, self._model = fabric, model
        self._epochs = Epochs(make_mode(mode_name, self._layout, settings, rank_counts=monitor is not None),
                              pad_uneven_ranks, "pass")
        if fabric.world_size > 1:  # the strategy's processes, though DDP's own group may hold this rank alone
            destroy_process_group_at_exit()
        if monitor is not None:  # the audit counts as the accumulator does
            monitor.auditing.attach(model, settings.count_fn, loss_reduction, aux=mode_name == "lookahead",
                                    world=self._layout.world)  # its collectives over the ranks that share N
        self._monitor: FabricMonitor | _Unmonitored = monitor or _Unmonitored()
        self._passes = _Passes(fabric, model, accumulate, self._epochs, self._monitor)
        self._last_window: WindowStats | None = None

    @property
    def accumulating(self) -> bool:
        """True while the batch in flight is not its window's last (its gradient must not be reduced yet)."""
        return not _InFlight.of(self._passes.flight, "`accumulating`").micro.last

    @property
    def is_filler_batch(self) -> bool:
        """True from the yield of a zero-weight repeat of an exhausted rank to its :meth:`backward` (the Trainer
        strategies' ``is_filler_batch``, ``token_mean.in_filler_batch()``); False for any other batch."""
        flight = self._passes.flight
        return flight is not None and flight.micro.is_filler

    is_filler = is_filler_batch  # the name of the first release

    @property
    def last_window(self) -> WindowStats | None:
        """What the last finished window used (None before the first)."""
        return self._last_window

    @property
    def skipped_steps(self) -> int:
        """Windows that had no valid item on any rank (``finish().skipped``)."""
        return self._epochs.mode.skipped_steps

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """One pass over ``iterable`` (what ``fabric.setup_dataloaders`` returned, or any iterable of batches): every
        rank yields as many batches. A sized iterable costs one collective at the pass's start (the ranks agree on its
        length); a stream's end is agreed window by window."""
        return self._passes.start(iterable, "batches")

    def windows(self, iterable: Iterable[Any]) -> Iterator[BatchWindow]:
        """The pass of :meth:`batches`, one :class:`BatchWindow` at a time (torchtitan's loop shape): each window
        yields its batches (K, or fewer in a sized pass's last window), then ``window.finish()``.

        Example:
            >>> import torch
            >>> from lightning.fabric import Fabric
            >>> model = (fabric := Fabric(accelerator="cpu", devices=1)).setup(torch.nn.Linear(4, 3))
            >>> accumulator = TokenMeanAccumulator(fabric, model, accumulate=2)
            >>> batches = [{"x": torch.randn(2, 4), "labels": torch.tensor([0, -100])} for _ in range(3)]
            >>> for window in accumulator.windows(batches):
            ...     for batch in window:
            ...         loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"], ignore_index=-100)
            ...         accumulator.backward(loss)
            ...     print(window.finish().window_length)  # K = 2, then the short last window
            2
            1
        """
        return _windows(self, self._passes, self._passes.start(iterable, "windows"))

    def backward(self, loss: Tensor, *args: Any, aux_loss: Tensor | None = None, num_items: Any = None,
                 **kwargs: Any) -> None:
        """Back-propagate the micro-batch's ``loss`` (its mean over its valid items, or their sum), scaled for the
        window's exact token mean, through ``fabric.backward`` (``args`` and ``kwargs`` go there too).

        ``aux_loss``: an auxiliary term averaged over the window's real micro-batches on all ranks (lookahead only);
        ``num_items``: this micro-batch's count as the model computed it (checked against ``count_fn``; deferred
        mode normalizes by it).
        """
        flight = _InFlight.of(self._passes.flight, "`accumulator.backward(loss)`")
        flight.backward()
        flight.check_sync(self._layout.sync_flags())
        scaled = flight.micro.loss_to_backprop(StepOutput(loss, aux_loss, num_items, loss), flight.batch)
        self._fabric.backward(scaled, *args, model=self._model, **kwargs)
        flight.micro.backward_done()

    def finish(self) -> WindowStats:
        """After the window's last backward: its stats (the window's one host read). The gradient is then the
        window's exact token mean; every rank raises the same :class:`~token_mean.DenominatorError` here if any rank
        had a problem. A window with N = 0 on every rank is ``skipped``: do not step the optimizer for it."""
        flight = _InFlight.of(self._passes.flight, "`accumulator.finish()`")
        flight.finish()
        stats = flight.micro.window_result()
        flight.finished = True
        self._passes.progress.windows += 1
        self._last_window = stats = self._monitor.finished(self._model, stats)
        return stats

    def state_dict(self) -> dict[str, Any]:
        """What resuming at a window boundary needs (identical on every rank): save it with the model and optimizer.

        Raises:
            RuntimeError: in the middle of a window (Fabric saves no partial gradient): save after ``finish()``.
        """
        flight = self._passes.flight
        if flight is not None:
            flight.saved()
        in_flight = None if flight is None else flight.micro.position + 1
        return {"mode": self._epochs.mode.state_dict(), **self._passes.progress.state_dict(in_flight)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``batches(...)`` skips the batches the saved pass had trained (the loader must yield
        them in the same order; a loader from ``fabric.setup_dataloaders`` gets its saved pass counter back, the
        epoch its sampler orders by).

        Raises:
            ValueError: for a checkpoint written in the middle of a pass by another number of processes.
        """
        self._passes.progress.load_state_dict(state)
        self._epochs.mode.load_state_dict(state["mode"])
        self._monitor.resume_at(self._passes.progress.windows)


class _Passes:
    """The accumulator's passes over the loop's batches: one at a time, each resumed where a checkpoint stopped, and
    the micro-batch the loop is training (from its yield to the next); how each pass ended is its ``progress``."""

    def __init__(self, fabric: Any, model: Any, accumulate: int, epochs: Epochs,
                 monitor: FabricMonitor | _Unmonitored) -> None:
        self._fabric, self._model, self._accumulate = fabric, model, accumulate
        self._epochs, self._monitor = epochs, monitor
        self.progress = Progress(epochs.mode.world_size)
        self.flight: _InFlight | None = None
        self._iterating: str | None = None  # "batches" or "windows": the accumulator's method that made the pass

    def start(self, iterable: Iterable[Any], name: str) -> Generator[Any, None, None]:
        self._one_at_a_time()
        return self._pass(iterable, name)

    def _one_at_a_time(self) -> None:
        if self._iterating is not None:
            raise RuntimeError(f"`accumulator.{self._iterating}(...)` is already being iterated: one pass at a time.")

    def _pass(self, iterable: Iterable[Any], name: str) -> Generator[Any, None, None]:
        self._one_at_a_time()  # two passes made before either started (`zip`)
        self._iterating, completed = name, False
        try:
            epoch, move, start = self._begin(iterable)
            for position in itertools.count(start):
                self._check_previous_batch()
                try:
                    item = epoch.next_item()
                except StopIteration:
                    completed = True
                    break
                micro = epoch.micro_batch(position, self._accumulate, self._windows_finished)
                flight = self.flight = _InFlight(micro, move(item[0]))
                self._monitor.micro_batch(self._model, flight.batch, micro.filler)
                yield flight.batch
        finally:
            self._iterating = None
            last, self.flight = self.flight, None
            self.progress.left(*_where_left(last, completed, self._accumulate, self._model))
            self._monitor.stepped(self._model)

    def _begin(self, iterable: Iterable[Any]) -> tuple[Epoch, Callable[[Any], Any], int]:
        """A pass starts: its epoch, what moves a batch to the device, and its first position (where a checkpoint
        stopped)."""
        start, loader_epoch = self.progress.start_pass()
        lookahead = self._epochs.mode.name == "lookahead"
        reader, move, loader_pass = _reader(iterable, start, loader_epoch, self._epochs, lookahead)
        self.progress.reading(loader_pass)
        _refuse_partial_gradient(self.progress.take_abandoned(), self._model)
        epoch = self._epochs.begin(reader, self.progress.passes)
        self._monitor.start(self._fabric)
        return epoch, move, start

    def _windows_finished(self) -> int:
        return self.progress.windows

    def _check_previous_batch(self) -> None:
        flight = self.flight
        if flight is not None:
            flight.done()
            if flight.micro.last:
                self._monitor.stepped(self._model)


class BatchWindow:
    """One window of :meth:`TokenMeanAccumulator.windows`: iterate it once for its batches (each through
    ``accumulator.backward(loss)``), then :meth:`finish` it. Its iteration ends with the window's last batch, before
    the pass reads the next one."""

    def __init__(self, accumulator: TokenMeanAccumulator, passes: _Passes, first: Any,
                 following: Iterator[Any]) -> None:
        self._accumulator, self._passes = accumulator, passes
        self._first, self._following = first, following
        self._iterated = False

    @property
    def accumulating(self) -> bool:
        """``accumulator.accumulating``: True while the batch in flight is not the window's last."""
        return self._accumulator.accumulating

    def finish(self) -> WindowStats:
        """``accumulator.finish()``, after the window's last backward: its stats (then step, unless ``skipped``).

        Raises:
            RuntimeError: before the window yielded its last batch, or as ``accumulator.finish()`` does.
        """
        _left_window(self._passes)
        return self._accumulator.finish()

    def __iter__(self) -> Iterator[Any]:
        if self._iterated:
            raise RuntimeError(
                "A window of `accumulator.windows(...)` is iterated twice: its batches come once, from the pass."
            )
        self._iterated = True
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        first, self._first = self._first, None  # the window holds no batch the loop has taken
        for batch in itertools.chain([first], self._following):
            last = not self._accumulator.accumulating  # of this batch: asked before the loop runs its backward
            yield batch
            if last:  # the next batch opens the next window: left in the pass, unread
                return


def _windows(accumulator: TokenMeanAccumulator, passes: _Passes,
             batches: Generator[Any, None, None]) -> Iterator[BatchWindow]:
    """The pass ``batches`` cut into windows: a window's first batch is read when the loop asks for the window, as
    ``batches()`` reads it when the loop asks for it (after the last window's finish and step)."""
    with contextlib.closing(batches):  # leaving the windows leaves the pass: it records where
        for first in batches:
            yield BatchWindow(accumulator, passes, first, batches)
            _left_window(passes)  # before the pass reads on (its own checks follow)


def _left_window(passes: _Passes) -> None:
    if passes.flight is not None:  # None once the pass has ended: nothing was left in it
        passes.flight.window_left()


class _Unmonitored:
    """What the accumulator tells its monitor, when it has none."""

    def micro_batch(self, model: Any, batch: Any, filler: bool = False) -> None:
        pass

    def start(self, fabric: Any) -> None:
        pass

    def stepped(self, model: Any) -> None:
        pass

    def finished(self, model: Any, stats: WindowStats) -> WindowStats:
        return stats

    def resume_at(self, step: int) -> None:
        pass


def _checked_model(fabric: Any, model: Any, accumulate: object) -> tuple[Any, Any]:
    """``(forward module, original module)`` of the model ``fabric.setup`` returned, or a ``ValueError``."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"`accumulate` must be a positive int (micro-batches per window), got {accumulate!r}.")
    modules = _lightning.fabric_modules(model)
    if modules is None or _lightning.fabric_strategy_of(model) is not fabric.strategy:
        raise ValueError(
            f"`model` must be what `fabric.setup(model)` (or `fabric.setup_module`) returned for this Fabric, got"
            f" {type(model).__name__}: the accumulator hooks into the module the strategy wrapped."
        )
    return modules


def _layout(fabric: Any, forward: Any, original: Any) -> Layout:
    """The core's view of Fabric's strategy (the shared ``_ddp`` and ``_fsdp`` layouts)."""
    from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy
    from lightning.fabric.strategies.fsdp import FSDPStrategy
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy

    strategy = fabric.strategy
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        why = ("FSDP1 needs a GPU, where this package is not tested: use `ModelParallelStrategy` (FSDP2)"
               if isinstance(strategy, FSDPStrategy) else "Fabric's `no_backward_sync` does nothing under DeepSpeed")
        raise ValueError(f"`TokenMeanAccumulator` does not support `{type(strategy).__name__}`: {why}.")
    layout = _strategy_layout(strategy, forward, original)
    if layout is None:
        raise ValueError(
            f"`TokenMeanAccumulator` does not support `{type(strategy).__name__}`: use one device, `DDPStrategy` or"
            " `ModelParallelStrategy`."
        )
    if isinstance(strategy, ModelParallelStrategy):
        _fsdp.check_reduction(forward, layout.world.size, "TokenMeanAccumulator")
    return layout


def _strategy_layout(strategy: Any, forward: Any, original: Any) -> Layout | None:
    """The layout of one device, ``DDPStrategy`` or ``ModelParallelStrategy`` (None for any other strategy)."""
    from lightning.fabric.strategies.ddp import DDPStrategy
    from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
    from lightning.fabric.strategies.single_device import SingleDeviceStrategy

    device = strategy.root_device
    if isinstance(strategy, SingleDeviceStrategy):
        return _ddp.single_layout(original, device)  # a default group the user initialized is not its world
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy):  # DeepSpeed derives from it
        return _ddp.layout(forward, device)
    if isinstance(strategy, ModelParallelStrategy):
        return _fsdp.layout(forward, strategy.device_mesh, device)
    return None


def loop_world(strategy: Any, forward: Any, original: Any) -> World:
    """The ranks that share the denominator of a loop without the accumulator (``FabricMonitor``'s audit): those the
    accumulator's layout would have; under a strategy it does not support (DeepSpeed, FSDP1), the default group's."""
    layout = _strategy_layout(strategy, forward, original)
    return _ddp.default_world(strategy.root_device) if layout is None else layout.world


def _reader(
    iterable: Iterable[Any], start: int, epoch: int | None, epochs: Epochs, lookahead: bool
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
    epochs.agree(local, local)
    loader_pass = _lightning.fabric_loader_pass(iterable, epoch)
    move: Callable[[Any], Any] = _unchanged
    if lookahead:
        host = _lightning.fabric_host_batches(iterable)
        if host is not None:
            iterable, move = host
    last, following = _skip(iter(iterable), start)
    reader = Reader(lambda: (next(following),), None, lambda: start, skipped=True)
    if last is not None:  # this rank had run out: its last batch is repeated at weight zero
        reader.adopt([(last,)])
    epochs.resume(last is not None)
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


__all__ = ["BatchWindow", "TokenMeanAccumulator"]  # FabricMonitor is importable here too, defined in fabric_monitor
