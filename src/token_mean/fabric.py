"""``TokenMeanAccumulator``: the exact token mean in a hand-written Lightning Fabric loop (LitGPT's or torchtitan's).

A loop that accumulates ``fabric.backward(loss / K)`` optimizes a mean of means; the accumulator changes it in five
lines: see :class:`TokenMeanAccumulator` and ``docs/fabric.md`` (windows, checkpoints, supported strategies).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from lightning.fabric.utilities import rank_zero_warn
from lightning.fabric.utilities.data import sized_len
from torch import Tensor
from torch.utils.data import IterableDataset

from token_mean import _lightning, _torch
from token_mean._checkpoint import Progress
from token_mean._epoch import Epoch, Passes
from token_mean._exit import destroy_process_group_at_exit
from token_mean._layout import Layout, World, check_reduction, layout, stand_in_loss
from token_mean._modes import make_mode
from token_mean._observers import Replay, first_window_observers
from token_mean._reader import Reader
from token_mean._settings import CountFn, LossReduction, Mode, Settings, checked_settings, positive_int
from token_mean._window import MicroBatch, StepOutput
from token_mean.results import WindowStats


class Monitor(Protocol):
    """What the accumulator tells a monitor (:class:`~token_mean.fabric_monitor.FabricMonitor`) of its windows."""

    audit_loss: Callable[[Any, Any], Any] | None

    def attach(self, model: Any, settings: Settings, world: World) -> None: ...
    def start(self, fabric: Any) -> None: ...
    def micro_batch(self, model: Any, batch: Any, filler: bool = False) -> None: ...
    def finished(self, model: Any, stats: WindowStats) -> WindowStats: ...
    def stepped(self, model: Any) -> None: ...
    def resume_at(self, step: int) -> None: ...


class TokenMeanAccumulator:
    r"""Accumulate K micro-batches per rank into one exact token-mean gradient, in a Lightning Fabric loop.

    Each window of K micro-batches per rank (a pass's last may be short) is normalized by its own N, at one collective
    per window; a rank whose loader runs out repeats its last batch at weight zero.

    Args:
        fabric, model: the launched ``Fabric``, and what its ``setup`` (or ``setup_module``) returned.
        accumulate: K, the micro-batches per rank and window.
        count_fn, loss_reduction, mode, pad_uneven_ranks, check_count: as for the Trainer strategies.
        monitor: a :class:`~token_mean.fabric_monitor.FabricMonitor` that logs every window and writes a trace.
        loss_fn: ``fn(model, batch) -> loss``, the loss the loop passes to :meth:`backward`: the count check
            replays it at the first window (without it, nor a monitor's ``audit_loss``, a warning says it cannot).

    Raises:
        ValueError: a bad setting, a model not from ``fabric.setup``, a strategy but one device, DDP and FSDP2.

    Example:
        >>> import torch
        >>> from lightning.fabric import Fabric
        >>> fabric = Fabric(accelerator="cpu", devices=1)
        >>> model = fabric.setup(torch.nn.Linear(4, 3))
        >>> def loss_fn(model, batch):  # the count check replays it at the first window
        ...     return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"], ignore_index=-100)
        >>> accumulator = TokenMeanAccumulator(fabric, model, accumulate=2, loss_fn=loss_fn)
        >>> batches = [{"x": torch.randn(2, 4), "labels": torch.tensor([0, -100])} for _ in range(3)]
        >>> for batch in accumulator.batches(batches):
        ...     accumulator.backward(loss_fn(model, batch))
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
        monitor: Monitor | None = None,
        check_count: bool = True,
        loss_fn: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        settings = checked_settings(count_fn, loss_reduction, mode, pad_uneven_ranks, check_count)
        self._accumulate: int = positive_int(accumulate, "accumulate", "micro-batches per window")  # type: ignore[assignment]
        self._layout = _fabric_layout(fabric, model, self._accumulate)
        self._fabric, self._model = fabric, model
        self._passes = Passes(make_mode(settings, self._layout, monitor is not None), pad_uneven_ranks, "pass")
        if fabric.world_size > 1:  # the strategy's processes, though DDP's own group may hold this rank alone
            destroy_process_group_at_exit()
        self._monitor = monitor
        if monitor is not None:  # the audit counts as the accumulator does, over the ranks that share N
            monitor.attach(model, settings, self._layout.world)
        self._progress = Progress(self._layout.world.size)
        self._micro: MicroBatch | None = None  # the micro-batch the loop is training, from its yield to the next
        self._batch: Any = None  # the batch the loop got for it
        self._iterating: str | None = None  # "batches" or "windows": the method that made the pass in progress
        self._last_window: WindowStats | None = None
        self._foreign: int | None = None  # trainable parameters the loss reaches outside the model (checked once)
        self._loss_fn = _checked_loss_fn(loss_fn, monitor)
        self._first_window = first_window_observers(settings, replayable=self._loss_fn is not None)

    @property
    def accumulating(self) -> bool:
        """True while the batch in flight is not its window's last (its gradient must not be reduced yet)."""
        return not self._in_flight("`accumulating`").last

    @property
    def is_filler_batch(self) -> bool:
        """True from the yield of a zero-weight repeat of an exhausted rank to its :meth:`backward`."""
        return self._micro is not None and self._micro.is_filler

    @property
    def last_window(self) -> WindowStats | None:
        """What the last finished window used (None before the first)."""
        return self._last_window

    @property
    def skipped_steps(self) -> int:
        """Windows that had no valid item on any rank (``finish().skipped``)."""
        return self._passes.mode.skipped_steps

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """One pass over ``iterable`` (a Fabric loader or any iterable of batches); every rank yields as many."""
        _one_pass_at_a_time(self._iterating)
        return self._pass(iterable, "batches")

    def windows(self, iterable: Iterable[Any]) -> Iterator[BatchWindow]:
        """The pass of :meth:`batches`, one :class:`BatchWindow` at a time (torchtitan's loop shape)."""
        _one_pass_at_a_time(self._iterating)
        return _windows(self, self._pass(iterable, "windows"))

    def backward(
        self,
        loss: Tensor | Mapping[str, Tensor],
        *args: Any,
        aux_loss: Tensor | None = None,
        num_items: Any = None,
        **kwargs: Any,
    ) -> None:
        """``fabric.backward`` of ``loss`` (a micro-batch's mean over valid items, or sum) scaled for the token mean;
        ``aux_loss``: averaged over real micro-batches; ``num_items``: the model's count (checked; deferred uses it).
        An objective of several terms (``count_fn={name: count}``) passes ``{name: loss}``."""
        micro = self._in_flight("`accumulator.backward(loss)`")
        _check_backward_once(micro)
        _check_sync(self._layout.sync_flags(), micro)
        output = _step_output(loss, aux_loss, num_items, self._passes.mode.settings.terms, self._model)
        if self._foreign is None:  # once: in deferred mode the loss must reach the accumulator's model's alone
            self._foreign = 0 if self._passes.mode.reads_ahead else _foreign_parameters(output.backprop, self._model)
        for observer in self._first_window:
            observer.trained(loss)  # what the micro-batch trained on: a replay must give it
        scaled = micro.loss_to_backprop(output, self._batch)
        self._fabric.backward(scaled, *args, model=self._model, **kwargs)
        micro.backward_done()

    def finish(self) -> WindowStats:
        """After the window's last backward: its stats (one host read; a :class:`~token_mean.DenominatorError` on every
        rank if any had a problem). The gradient is then the token mean; do not step for a ``skipped`` window."""
        micro, epoch = self._in_flight("`accumulator.finish()`"), self._passes.current
        _check_finish(micro)
        if epoch is None:
            raise RuntimeError("token_mean: internal error: a window finished outside a pass.")
        stats = epoch.end_window()
        if self._first_window:  # the first window ended (its count check runs here, on every rank)
            observers, self._first_window = self._first_window, []
            replay = _replay(self._model, self._loss_fn, self._layout.world)
            for observer in observers:
                observer.ended(replay, micro.window.where)
        self._progress.windows += 1
        if self._monitor is not None:
            stats = self._monitor.finished(self._model, stats)
        self._last_window = stats
        return stats

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs (alike on every rank): save it after ``finish()``; a ``RuntimeError`` inside a window."""
        micro = self._micro
        _check_window_boundary(micro)
        in_flight = None if micro is None else micro.position + 1
        mode = self._passes.mode.state_dict()
        return {"mode": mode, "accumulate": self._accumulate, **self._progress.state_dict(in_flight)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``batches(...)`` skips what the saved pass trained (the loader must repeat its order). A
        ``ValueError`` for a checkpoint written mid-pass by another number of processes."""
        self._progress.load_state_dict(state)
        self._passes.mode.load_state_dict(state["mode"])
        _warn_another_k(state.get("accumulate"), int(state["position"]), self._accumulate)
        if self._monitor is not None:
            self._monitor.resume_at(self._progress.windows)

    def _in_flight(self, what: str) -> MicroBatch:
        if self._micro is None:
            raise RuntimeError(f"{what} is only defined for a batch that `accumulator.batches(...)` yielded.")
        return self._micro

    def _pass(self, iterable: Iterable[Any], name: str) -> Generator[Any, None, None]:
        _one_pass_at_a_time(self._iterating)  # two passes made before either started (`zip`)
        self._iterating, completed = name, False
        try:
            epoch, move, start = self._begin(iterable)
            for position in itertools.count(start):
                _batch_done(self._micro, self._monitor, self._model)
                try:
                    item = epoch.next_item()
                except StopIteration:
                    completed = True
                    break
                self._micro = epoch.micro_batch(position, self._accumulate, lambda: self._progress.windows)
                self._batch = move(item[0])
                if self._monitor is not None:
                    self._monitor.micro_batch(self._model, self._batch, self._micro.filler)
                for observer in self._first_window:
                    observer.micro_batch(self._batch, self._micro.filler, position)
                yield self._batch
        finally:
            self._iterating = None
            self._progress.left(*_where_left(self._micro, completed, self._accumulate, self._model))
            self._micro = self._batch = None
            if self._monitor is not None:
                self._monitor.stepped(self._model)

    def _begin(self, iterable: Iterable[Any]) -> tuple[Epoch, Callable[[Any], Any], int]:
        """A pass starts: its epoch, what moves a batch to the device, its first position (a checkpoint's)."""
        start, loader_epoch = self._progress.start_pass()
        local = None if isinstance(getattr(iterable, "dataset", None), IterableDataset) else sized_len(iterable)
        self._passes.agree(local, local)
        self._progress.loader_epoch = _lightning.fabric_loader_pass(iterable, loader_epoch)
        reader, move, exhausted = _reader(iterable, start, self._passes.mode.reads_ahead)
        self._passes.resume(exhausted)
        _refuse_partial_gradient(self._progress.take_abandoned(), self._model)
        epoch = self._passes.begin(reader, self._progress.passes)
        if self._monitor is not None:
            self._monitor.start(self._fabric)
        return epoch, move, start


def _checked_loss_fn(loss_fn: Any, monitor: Monitor | None) -> Callable[[Any, Any], Any] | None:
    """The loss the count check replays: ``loss_fn``, else a monitor's ``audit_loss`` (None: none to replay)."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be a callable fn(model, batch) -> loss, got {type(loss_fn).__name__}.")
    return loss_fn or (monitor.audit_loss if monitor is not None else None)


def _replay(model: Any, loss_fn: Any, world: World) -> Replay:
    """How the first window's observers replay the loop's loss: ``loss_fn(module, batch)`` on the unwrapped module."""
    modules, strategy = _lightning.fabric_modules(model), _lightning.fabric_strategy_of(model)
    if modules is None or strategy is None:
        raise RuntimeError("token_mean: internal error: the accumulator lost the model `fabric.setup` returned.")
    context = strategy.precision.forward_context
    return Replay(modules[1], lambda module, batch, index: loss_fn(module, batch), context, world, "the loss function")


class BatchWindow:
    """One window of :meth:`TokenMeanAccumulator.windows`: iterate it once (a ``RuntimeError`` twice) for its batches,
    each through ``accumulator.backward(loss)``, then :meth:`finish` it (``docs/fabric.md``)."""

    def __init__(self, accumulator: TokenMeanAccumulator, first: Any, following: Iterator[Any]) -> None:
        self._accumulator = accumulator
        self._first, self._following = first, following
        self._iterated = False

    @property
    def accumulating(self) -> bool:
        """``accumulator.accumulating``: True while the batch in flight is not the window's last."""
        return self._accumulator.accumulating

    def finish(self) -> WindowStats:
        """``accumulator.finish()``, after the window's last backward; a ``RuntimeError`` before its last batch."""
        _check_window_left(self._accumulator._micro)
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


def _windows(accumulator: TokenMeanAccumulator, batches: Generator[Any, None, None]) -> Iterator[BatchWindow]:
    """The pass ``batches`` cut into windows: a window's first batch is read when the loop asks for the window."""
    with contextlib.closing(batches):  # leaving the windows leaves the pass: it records where
        for first in batches:
            yield BatchWindow(accumulator, first, batches)
            _check_window_left(accumulator._micro)  # before the pass reads on (its own checks follow)


def _one_pass_at_a_time(iterating: str | None) -> None:
    if iterating is not None:
        raise RuntimeError(f"`accumulator.{iterating}(...)` is already being iterated: one pass at a time.")


def _batch_done(micro: MicroBatch | None, monitor: Monitor | None, model: Any) -> None:
    """The loop asks for the next batch: the one before ran its backward (and its window's finish, if last)."""
    if micro is None:
        return
    if not micro.backward_ran:
        raise RuntimeError(
            f"`accumulator.backward(loss)` was not called for batch {micro.position}: every batch the accumulator"
            " yields must run its backward (a filler's too), or the ranks fall out of step."
        )
    if micro.last and not micro.window.ended:
        raise RuntimeError(
            f"`accumulator.finish()` was not called after the last micro-batch of the window ending at batch"
            f" {micro.position}: call it when `accumulator.accumulating` is False, before the optimizer step."
        )
    if micro.last and monitor is not None:
        monitor.stepped(model)


def _check_window_left(micro: MicroBatch | None) -> None:
    if micro is not None and not micro.last:
        raise RuntimeError(
            f"A window of `accumulator.windows(...)` was finished or left at batch {micro.position}, before its last"
            " micro-batch: iterate each window to its end (`for batch in window:` without `break`), then call"
            " `window.finish()`."
        )


def _check_backward_once(micro: MicroBatch) -> None:
    if micro.backward_ran:
        raise RuntimeError(
            f"`accumulator.backward(loss)` was called twice for batch {micro.position}: its items"
            " would count twice. Call it once per batch."
        )


def _check_finish(micro: MicroBatch) -> None:
    if not micro.last or not micro.backward_ran or micro.window.ended:
        state = "is called twice" if micro.window.ended else "comes before the window's last backward"
        raise RuntimeError(
            f"`accumulator.finish()` {state} (batch {micro.position}): call it once per window,"
            " after `accumulator.backward(loss)` of the batch where `accumulating` is False."
        )


def _check_window_boundary(micro: MicroBatch | None) -> None:
    if micro is not None and not micro.window.ended:
        raise RuntimeError(
            "`accumulator.state_dict()` in the middle of a window: its partial gradient is not"
            " saved. Save after `accumulator.finish()` and the optimizer step."
        )


def _check_sync(flags: Sequence[bool], micro: MicroBatch) -> None:
    """The next backward reduces the gradient (by its host-side flags) if and only if it is the window's last."""
    if flags and set(flags) != {micro.last}:
        wrong = "would not reduce the window's gradient" if micro.last else "would reduce it mid-window"
        raise RuntimeError(
            f"The gradient sync of batch {micro.position} disagrees with the window: its backward {wrong}. Wrap each"
            " micro-batch's forward and backward in `with fabric.no_backward_sync(model,"
            " enabled=accumulator.accumulating):`."
        )


def _warn_another_k(saved: int | None, position: int, accumulate: int) -> None:
    """A mid-pass resume with another K than the checkpoint's: exact window by window, but say where windows fall."""
    if saved is not None and saved != accumulate and position > 0:
        stop = position + accumulate - position % accumulate
        rank_zero_warn(
            f"token_mean: resuming in the middle of a pass, at batch {position}, with `accumulate={accumulate}` where"
            f" the checkpoint was written with {saved}: windows are K apart from the pass's start, so the first"
            f" window after the resume holds batches {position}..{stop - 1}; every window is exact for its own"
            " batches (docs/fabric.md)."
        )


def _step_output(loss: Any, aux_loss: Tensor | None, num_items: Any, terms: Sequence[Any], model: Any) -> StepOutput:
    """What ``accumulator.backward`` was given, taken apart (several terms: a mapping of their losses)."""
    names = [term.name for term in terms]
    if names:  # a tensor where terms are expected is a mismatch the window raises on every rank
        given = {**loss, "num_items": num_items, "aux_loss": aux_loss} if isinstance(loss, Mapping) else {}
        return StepOutput.of(given, lambda: stand_in_loss(model), names)[0]
    if isinstance(loss, Tensor):
        return StepOutput(loss, aux_loss, num_items, loss)
    raise TypeError(
        f"`accumulator.backward(loss)` takes the micro-batch's loss tensor, got {type(loss).__name__}: a"
        " mapping of losses needs `count_fn` as a mapping of the same terms (docs/counts.md, objectives of"
        " several terms)."
    )


def _foreign_parameters(loss: Tensor, model: Any) -> int:
    """How many trainable tensors ``loss``'s autograd graph reaches that are not ``model``'s parameters (under FSDP2
    the leaves autograd records are the unsharded parameters); in deferred mode any is refused."""
    own = {id(parameter) for parameter in model.parameters()}
    own.update(id(unsharded) for _, unsharded in _torch.fsdp_parameter_pairs(model))
    seen: set[Any] = set()
    nodes, foreign = [loss.grad_fn], 0
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: a trainable leaf
        if leaf is not None:
            foreign += id(leaf) not in own
        else:
            nodes.extend(child for child, _ in node.next_functions)
    if foreign:
        raise ValueError(
            f"`mode='deferred'` normalizes the gradients of the model given to `TokenMeanAccumulator`, in its gradient"
            f" reduction, but the loss also reaches {foreign} parameters of another module (set up with"
            " `fabric.setup` on its own): their gradient would not be normalized by N. Use `mode='lookahead'`, whose"
            " scale is in the loss, or set the modules up as one `nn.Module`."
        )
    return foreign


def _fabric_layout(fabric: Any, model: Any, accumulate: int) -> Layout:
    """The modes' view of Fabric's strategy and the model ``fabric.setup`` returned, or a ``ValueError``."""
    from lightning.fabric.strategies.ddp import DDPStrategy
    from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy
    from lightning.fabric.strategies.fsdp import FSDPStrategy
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
    from lightning.fabric.strategies.single_device import SingleDeviceStrategy

    modules = _lightning.fabric_modules(model)
    if modules is None or _lightning.fabric_strategy_of(model) is not fabric.strategy:
        raise ValueError(
            f"`model` must be what `fabric.setup(model)` (or `fabric.setup_module`) returned for this Fabric, got"
            f" {type(model).__name__}: the accumulator hooks into the module the strategy wrapped."
        )
    strategy, forward = fabric.strategy, modules[0]
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        why = (
            "FSDP1 needs a GPU, where this package is not tested: use `ModelParallelStrategy` (FSDP2)"
            if isinstance(strategy, FSDPStrategy)
            else "Fabric's `no_backward_sync` does nothing under DeepSpeed"
        )
        raise ValueError(f"`TokenMeanAccumulator` does not support `{type(strategy).__name__}`: {why}.")
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
        raise ValueError(
            f"`TokenMeanAccumulator` does not support `{type(strategy).__name__}`: use one device, `DDPStrategy` or"
            " `ModelParallelStrategy`."
        )
    result = layout(strategy, forward)
    _lightning.refuse_static_graph(strategy, "TokenMeanAccumulator", "accumulate", accumulate)
    if isinstance(strategy, ModelParallelStrategy):
        check_reduction(forward, result.world.size, "TokenMeanAccumulator")
    return result


Gradients = list[tuple["weakref.ref[Tensor]", int]]
"""The parameters' gradients, weakly (one set to None since is freed), each with its version counter."""


def _reader(iterable: Iterable[Any], start: int, reads_ahead: bool) -> tuple[Reader, Callable[[Any], Any], bool]:
    """A pass's reader from ``start``, what moves a batch to the device as the loop takes it, and whether the loader
    had run out. Lookahead reads a Fabric loader's host batches: counting a device batch would be a host read."""
    move: Callable[[Any], Any] = _unchanged
    host = _lightning.fabric_host_batches(iterable) if reads_ahead else None
    if host is not None:
        iterable, move = host
    last, following = _skip(iter(iterable), start)
    reader = Reader(lambda: (next(following),), None, lambda: start, skipped=True)
    if last is not None:
        reader.adopt([(last,)])
    return reader, move, last is not None


def _where_left(
    micro: MicroBatch | None, completed: bool, accumulate: int, model: Any
) -> tuple[int | None, tuple[int, Gradients] | None]:
    """How a pass ended (``Progress.left``): run out, left at a window boundary, or inside one (with its gradients)."""
    if micro is None or completed:
        return None, None
    if micro.last and micro.window.ended:  # its window was finished
        return micro.position + 1, None
    if not micro.backward_ran and micro.position % accumulate == 0:  # windows are K apart from the pass's start
        return micro.position, None
    gradients = [grad for p in model.parameters() if (grad := p.grad) is not None]
    return None, (micro.position, [(weakref.ref(grad), _torch.version(grad)) for grad in gradients])


def _refuse_partial_gradient(abandoned: tuple[int, Gradients] | None, model: Any) -> None:
    """A partial window's gradient must not go into the next update, unless zeroed since: judged by version counters,
    alike on every rank (values would not be: a rank of fillers holds zeros). FSDP2's unsharded copy is dropped."""
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


def _skip(iterator: Iterator[Any], count: int) -> tuple[Any | None, Iterator[Any]]:
    """Skip ``count`` items: ``(the last, iterator)`` if it ran out (a filler repeats that), else ``(None, rest)``."""
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


__all__ = ["BatchWindow", "TokenMeanAccumulator"]
