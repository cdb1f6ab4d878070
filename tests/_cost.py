"""Count what a fit costs besides the model: collectives, host reads of tensor values, dispatched aten ops.

Shared by ``tests/test_cost.py``, which pins the numbers, and ``benchmarks/cost.py``, which records them. Inside each
forked worker a :class:`CostCounter` callback pushes a ``TorchDispatchMode`` that sees every aten op and every c10d
collective dispatched on the training thread (the autograd engine runs CPU backward passes there too, so DDP's
gradient all-reduce is seen, whether its C++ reducer or deferred mode's Python hook issues it), and replaces
``Tensor.tolist``, ``numpy`` and ``cpu``, which read a tensor without dispatching an op. ``item()``, ``bool()``,
``float()`` and ``int()`` of a tensor all dispatch ``aten._local_scalar_dense``, so they are counted there.

Every event is filed under the micro-batch *cycle* it happens in: from the strategy's ``training_step`` of one
micro-batch to that of the next, so Lightning's loop, the batch fetch and the callbacks' hooks belong to the cycle
they follow. A window is its K cycles; the epoch's last cycle runs on to the next epoch's first ``training_step``.
Events between a window's first forward (``LightningModule.training_step``) and the end of its last backward
(``LightningModule.backward``; the strategy reads the window's record after it, in its ``backward`` hook) are also
filed under the window's *in-window* tally: on a GPU a host read there would stall the device before a backward.

Each event also gets an origin from the Python stack: ``host_count`` when ``token_mean._counts.read_count`` is on
it (lookahead counting the batch the loader yielded: a CPU tensor, so reading it never waits for an accelerator),
``count`` when the count function
(``count_valid_labels``, the default in these runs) is on it otherwise (a device batch, the monitor's count),
``token_mean`` when the innermost frame outside torch is in the package, else ``other`` (Lightning, DDP, the model).
The figures that the tests pin are differences against plain ``DDPStrategy`` in the same harness, so Lightning's own
per-batch costs (a SIGTERM ``broadcast`` and its ``.item()`` before every batch under DDP) are netted out; the
origins are a cross-check.

:class:`Tallies` is the counting itself; :class:`CostCounter` tells it the Trainer's cycles and windows, and
``tests/_fabric_cost.py`` a Fabric loop's (LitGPT's shape). :func:`summarize` and :func:`table_rows` serve both.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import Batch, TokenModule, sft_batches, strategy_for, train
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

import token_mean
from token_mean import DenominatorMonitor, _lightning
from token_mean._counts import count_shifted_labels, count_valid_labels, read_count

DEVICES, ACCUMULATE = 2, 4
WINDOWS_PER_EPOCH, EPOCHS = 3, 3
STEADY_EPOCH, STEADY_WINDOW = 1, 1  # a window with another window before and after it in its epoch, in a middle epoch
BATCHES = WINDOWS_PER_EPOCH * ACCUMULATE  # per rank and epoch
LOADERS = ("sized", "unsized")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TOKEN_MEAN_DIR = os.path.dirname(token_mean.__file__) + os.sep
_HOST_COUNTS = (read_count.__code__,)
_COUNT_FNS = (count_valid_labels.__code__, count_shifted_labels.__code__)  # the runs' count_fn
_THIS_FILE = __file__
_READS_WITHOUT_AN_OP = ("tolist", "numpy", "cpu")  # host reads that dispatch no aten op (item() dispatches one)
Tally = collections.Counter[str]
# torch 2.6 to 2.9 show a Python dispatch mode each `detach` twice in a row (`x.detach()` dispatches
# aten.detach.default two times; `.numpy()`'s detach too); from 2.10 on once (probed on 2.6, 2.7.1, 2.8.0, 2.9.1,
# 2.10.0, 2.15.0). The counter takes each pair as one op, so that the pinned counts say the same on every torch.
_DETACH_DISPATCHED_TWICE = torch.__version__ < (2, 10)


def wrap_around(owner: Any, name: str, before: Callable[[], None] | None, after: Callable[[], None] | None) -> None:
    """Run ``before`` and ``after`` around ``owner.name`` (an instance attribute in front of the method)."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        try:
            return original(*args, **kwargs)
        finally:
            if after is not None:
                after()

    setattr(owner, name, wrapped)


def _origin() -> str:
    """Who caused the event being counted: ``host_count``, ``count``, ``token_mean`` or ``other`` (module docstring)."""
    frame = sys._getframe(2)
    innermost: str | None = None
    counting = False
    while frame is not None:
        if frame.f_code in _HOST_COUNTS:
            return "host_count"
        counting = counting or frame.f_code in _COUNT_FNS
        filename = frame.f_code.co_filename
        if innermost is None and not filename.startswith(_TORCH_DIR) and filename != _THIS_FILE:
            innermost = filename
        frame = frame.f_back  # type: ignore[assignment]
    if counting:
        return "count"
    return "token_mean" if innermost is not None and innermost.startswith(_TOKEN_MEAN_DIR) else "other"


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: CostCounter) -> None:
        super().__init__()
        self.counter = counter
        self._second_detach = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _DETACH_DISPATCHED_TWICE and func is torch.ops.aten.detach.default:
            self._second_detach = not self._second_detach
            if not self._second_detach:
                return func(*args, **(kwargs or {}))
        self.counter.dispatched(str(func.overloadpacket.__name__), func.namespace)
        return func(*args, **(kwargs or {}))


class Tallies:
    """Files every collective, host read and aten op under its micro-batch cycle, and under its window's in-window
    tally between the window's first forward and the end of its last backward; the front end says when those are.

    ``start`` replaces ``Tensor.tolist``, ``numpy`` and ``cpu`` and enters the dispatch mode, ``stop`` undoes it and
    every ``wrap``; ``write`` saves the tallies (``rank{r}.json``, read back by :func:`summarize`).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cycles: dict[str, Tally] = collections.defaultdict(collections.Counter)
        self.in_window: dict[str, Tally] = collections.defaultdict(collections.Counter)
        self._cycle = "setup"
        self._window: tuple[int, int] | None = None  # (epoch, window) whose first forward ran and last backward not
        self._epoch = -1
        self._window_index = -1
        self._steps_now = False
        self._in_backward = False
        self._reading = threading.local()
        self._mode: _Dispatch | None = None
        self._restore: list[Callable[[], None]] = []

    # ------------------------------------------------------------------------------------------------ recording

    def _record(self, category: str) -> None:
        self.cycles[self._cycle][category] += 1
        if self._window is not None:
            self.in_window[f"{self._window[0]}/{self._window[1]}"][category] += 1

    def dispatched(self, name: str, namespace: str) -> None:
        if namespace == "c10d":
            # DDP's gradient all-reduce runs inside backward, in every run alike: kept apart from the extras
            self._record(f"{'gradient' if self._in_backward else 'collective'}:{name.rstrip('_')}")
        elif namespace == "aten":
            if name == "_local_scalar_dense":
                if not getattr(self._reading, "depth", 0):
                    self._record(f"read:{_origin()}")
                return
            self._record("op")
            origin = _origin()
            if origin != "other":
                self._record(f"op:{origin}")
            self._record(f"op-name:{name}")

    def _read_without_op(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter._record(f"read:{_origin()}")
            counter._reading.depth = getattr(counter._reading, "depth", 0) + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._reading.depth -= 1

        read.__name__ = name
        return read

    # ------------------------------------------------------------------------------------------------ phases

    def wrap(self, owner: Any, name: str, before: Callable[[], None] | None, after: Callable[[], None] | None) -> None:
        """``owner.name`` (an instance's method) runs ``before`` and ``after`` around itself until ``stop``."""
        wrap_around(owner, name, before, after)
        self._restore.append(lambda: owner.__dict__.pop(name, None))

    def cycle(self, epoch: int, window: int, micro: int, steps_now: bool) -> None:
        """A micro-batch cycle starts: micro-batch ``micro`` of ``window`` of ``epoch``; ``steps_now``: its window's
        last (the window ends with its backward)."""
        self._epoch, self._window_index, self._steps_now = epoch, window, steps_now
        self._cycle = f"{epoch}/{window}/{micro}"

    def first_forward(self) -> None:
        if self._window is None:
            self._window = (self._epoch, self._window_index)

    def backward_starts(self) -> None:
        self._in_backward = True

    def backward_done(self) -> None:
        self._in_backward = False
        if self._steps_now:
            self._window = None

    def start(self) -> None:
        for name in _READS_WITHOUT_AN_OP:
            saved = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._read_without_op(name, getattr(torch.Tensor, name)))
            self._restore.append(
                (lambda n=name, s=saved: setattr(torch.Tensor, n, s))
                if saved is not None
                else (lambda n=name: delattr(torch.Tensor, n))
            )
        self._mode = _Dispatch(self)
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()

    def write(self, rank: int) -> None:
        record = {"cycles": self.cycles, "in_window": self.in_window}
        (self.directory / f"rank{rank}.json").write_text(json.dumps(record))


def collectives_issued(directory: Path, function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Tally]:
    """``function(*args, **kwargs)``'s result, and the c10d collectives it dispatched on this thread (gradient
    all-reduces in a backward included), by name."""
    counter = Tallies(directory)
    counter.start()
    try:
        result = function(*args, **kwargs)
    finally:
        counter.stop()
    issued = collections.Counter({name: count for tally in counter.cycles.values() for name, count in tally.items()
                                  if name.startswith(("collective:", "gradient:"))})
    return result, issued


class CostCounter(Tallies, Callback):
    """The Trainer's cycles: from the strategy's ``training_step`` of one micro-batch to that of the next; each rank
    writes ``rank{r}.json`` at teardown."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._micro: int | None = None  # position in the open window of the micro-batch in flight

    def _start_micro_batch(self, trainer: pl.Trainer) -> None:
        if trainer.current_epoch != self._epoch:
            self._epoch, self._window_index, self._micro = trainer.current_epoch, -1, None
        if self._micro is None:
            self._window_index += 1
            self._micro = 0
        else:
            self._micro += 1
        self.cycle(self._epoch, self._window_index, self._micro, _lightning.steps_after_this_batch(trainer))

    def backward_done(self) -> None:
        if self._steps_now:
            self._micro = None
        super().backward_done()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.wrap(trainer.strategy, "training_step", lambda: self._start_micro_batch(trainer), None)
        self.wrap(pl_module, "training_step", self.first_forward, None)
        # the backward itself, `LightningModule.backward` (`loss.backward()`): the strategy's `backward` hook also
        # reads the window's record after it, which is outside the window
        self.wrap(pl_module, "backward", self.backward_starts, self.backward_done)
        self.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.stop()
        self.write(trainer.global_rank)


# ---------------------------------------------------------------------------------------------------------------
# one run, and what it costs per micro-batch, per window and per epoch
# ---------------------------------------------------------------------------------------------------------------


def cost_data() -> list[list[Batch]]:
    """Ragged SFT-like micro-batches, none of them empty: every micro-batch takes the same code path."""
    return sft_batches("sft", DEVICES, BATCHES, seed=3)


def run(
    method: str,
    loader: str,
    monitor: bool,
    directory: Path,
    output_fn: Callable[[TokenModule, Batch, torch.Tensor], Any] | None = None,
) -> list[dict[str, Any]]:
    """One 2-rank fit of EPOCHS epochs of WINDOWS_PER_EPOCH windows of K = ACCUMULATE; every rank's tallies."""
    directory.mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = [CostCounter(directory)]
    if monitor:
        callbacks.append(DenominatorMonitor())
    module = TokenModule(cost_data(), iterable=loader == "unsized", output_fn=output_fn)
    train(
        module, strategy_for(method), DEVICES, callbacks=callbacks, accumulate_grad_batches=ACCUMULATE,
        max_epochs=EPOCHS, log_every_n_steps=1,
    )
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(DEVICES)]


@dataclass(frozen=True)
class Cost:
    """What one rank pays, in counts: per accumulating micro-batch, per window (K micro-batches), per epoch."""

    collectives_per_window: dict[str, int]  # by c10d op, DDP's gradient all-reduce left out
    collectives_per_epoch: dict[str, int]  # besides the windows' (at its start and end)
    gradient_per_window: dict[str, int]  # DDP's gradient all-reduce (the same in every run)
    reads_in_window: int  # host reads between the window's first forward and the end of its last backward
    reads_in_window_host_count: int  # of which of the CPU batch the loader yielded (lookahead's count_fn)
    reads_per_window: int  # all host reads of the window's K cycles
    reads_per_window_host_count: int
    reads_per_epoch: int
    ops_per_micro_batch: int  # aten ops of an accumulating micro-batch (neither the window's first nor its last)
    ops_per_micro_batch_count: int  # of which the count itself (count_fn, on the host or the device batch)
    ops_per_window: int
    ops_per_window_count: int
    ops_per_window_host: int  # of which on the CPU batch the loader yielded (lookahead's count_fn)
    ops_per_epoch: int
    ops_token_mean_per_window: int  # ops whose innermost non-torch frame is in token_mean (a cross-check)
    op_names_per_micro_batch: dict[str, int] = field(default_factory=dict)
    op_names_per_window: dict[str, int] = field(default_factory=dict)

    def minus(self, plain: Cost) -> Cost:
        """The extra over ``plain`` (negative where this run does less)."""
        values: dict[str, Any] = {}
        for name, mine in asdict(self).items():
            theirs = getattr(plain, name)
            if isinstance(mine, dict):
                difference = {k: mine.get(k, 0) - theirs.get(k, 0) for k in sorted(set(mine) | set(theirs))}
                values[name] = {k: v for k, v in difference.items() if v}
            else:
                values[name] = mine - theirs
        return Cost(**values)


def _sum(tallies: Iterator[Tally]) -> Tally:
    total: Tally = collections.Counter()
    for tally in tallies:
        total.update(tally)
    return total


def _window(cycles: dict[str, Tally], epoch: int, window: int) -> Tally:
    return _sum(cycles.get(f"{epoch}/{window}/{micro}", collections.Counter()) for micro in range(ACCUMULATE))


def _prefixed(tally: Tally, prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): v for k, v in sorted(tally.items()) if k.startswith(prefix) and v}


def _nonzero(tally: Tally) -> Tally:
    return collections.Counter({k: v for k, v in tally.items() if v})


def summarize(rank: dict[str, Any]) -> Cost:
    """One rank's tallies as a :class:`Cost`; raises if the windows that must cost the same do not."""
    cycles = {key: collections.Counter(value) for key, value in rank["cycles"].items()}
    in_window = {key: collections.Counter(value) for key, value in rank["in_window"].items()}
    window = _window(cycles, STEADY_EPOCH, STEADY_WINDOW)
    for epoch in range(STEADY_EPOCH, EPOCHS):  # every epoch's middle window costs the same: one steady state
        other = _window(cycles, epoch, STEADY_WINDOW)
        if _nonzero(other) != _nonzero(window):
            raise AssertionError(f"window {epoch}/{STEADY_WINDOW} differs from the steady window: {other - window}")
    micro = cycles[f"{STEADY_EPOCH}/{STEADY_WINDOW}/1"]
    for index in range(2, ACCUMULATE - 1):
        if _nonzero(cycles[f"{STEADY_EPOCH}/{STEADY_WINDOW}/{index}"]) != _nonzero(micro):
            raise AssertionError(f"micro-batch {index} of the steady window differs from micro-batch 1")
    epoch = _sum(_window(cycles, STEADY_EPOCH, index) for index in range(WINDOWS_PER_EPOCH))
    extra = collections.Counter(epoch)
    extra.subtract({k: WINDOWS_PER_EPOCH * v for k, v in window.items()})
    inside = in_window[f"{STEADY_EPOCH}/{STEADY_WINDOW}"]
    return Cost(
        collectives_per_window=_prefixed(window, "collective:"),
        collectives_per_epoch=_prefixed(extra, "collective:"),
        gradient_per_window=_prefixed(window, "gradient:"),
        reads_in_window=sum(_prefixed(inside, "read:").values()),
        reads_in_window_host_count=inside["read:host_count"],
        reads_per_window=sum(_prefixed(window, "read:").values()),
        reads_per_window_host_count=window["read:host_count"],
        reads_per_epoch=sum(_prefixed(extra, "read:").values()),
        ops_per_micro_batch=micro["op"],
        ops_per_micro_batch_count=micro["op:host_count"] + micro["op:count"],
        ops_per_window=window["op"],
        ops_per_window_count=window["op:host_count"] + window["op:count"],
        ops_per_window_host=window["op:host_count"],
        ops_per_epoch=extra["op"],
        ops_token_mean_per_window=window["op:token_mean"],
        op_names_per_micro_batch=_prefixed(micro, "op-name:"),
        op_names_per_window=_prefixed(window, "op-name:"),
    )


BASELINES = ("plain", "litgpt")  # plain DDPStrategy under the Trainer, LitGPT's loop under Fabric
LABELS = {"litgpt": "LitGPT loop"}


@dataclass(frozen=True)
class Row:
    method: str
    loader: str
    monitor: bool
    cost: Cost  # absolute for a baseline without the monitor, else the extra over it (same loader)

    @property
    def absolute(self) -> bool:
        return self.method in BASELINES and not self.monitor


def measure(loader: str, directory: Path, monitors: tuple[bool, ...] = (False, True)) -> list[Row]:
    """Plain DDP, lookahead and deferred, each without and with ``DenominatorMonitor``, on one kind of loader."""
    plain: Cost | None = None
    rows = []
    for monitor in monitors:
        for method in ("plain", "lookahead", "deferred"):
            ranks = run(method, loader, monitor, directory / f"{loader}-{method}-{'monitor' if monitor else 'bare'}")
            costs = [summarize(rank) for rank in ranks]
            if costs[0].collectives_per_window != costs[1].collectives_per_window:
                raise AssertionError(f"ranks run different collectives: {costs}")
            cost = costs[0]
            if method == "plain" and not monitor:
                plain = cost
                rows.append(Row(method, loader, monitor, cost))
            else:
                if plain is None:
                    raise ValueError("measure plain DDP without the monitor first: it is the baseline")
                rows.append(Row(method, loader, monitor, cost.minus(plain)))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------


def _collectives(counts: dict[str, int], signed: bool) -> str:
    if not counts:
        return "0"
    return ", ".join(f"{_signed(n, signed)} {name}" for name, n in counts.items())


def _signed(value: int, signed: bool) -> str:
    return f"+{value}" if signed and value > 0 else str(value)


def _of(value: int, part: int, signed: bool, what: str) -> str:
    return _signed(value, signed) + (f" ({part} {what})" if part else "")


def _reads(total: int, host_count: int, signed: bool) -> str:
    """Reads of device values first (what must be 0 before a backward), then the count of the CPU batch."""
    return _signed(total - host_count, signed) + (f" (+{host_count} count_fn, CPU batch)" if host_count else "")


TABLE_HEADERS = (
    "loader", "run", "collectives / window", "collectives / epoch", "host reads, first forward → last backward",
    "host reads / window", "host reads / epoch", "aten ops / micro-batch", "aten ops / window", "aten ops / epoch",
)


def table_rows(rows: list[Row]) -> list[list[str]]:
    """One line per run: absolute for a baseline (plain DDP, LitGPT's loop) without the monitor, the extra over it for
    the others."""
    body = []
    for row in rows:
        cost, signed = row.cost, not row.absolute
        name = f"{LABELS.get(row.method, row.method)}{' + monitor' if row.monitor else ''}"
        body.append([
            row.loader,
            f"{name} (extra)" if signed else f"{name} (absolute)",
            _collectives(cost.collectives_per_window, signed),
            _collectives(cost.collectives_per_epoch, signed),
            _reads(cost.reads_in_window, cost.reads_in_window_host_count, signed),
            _reads(cost.reads_per_window, cost.reads_per_window_host_count, signed),
            _signed(cost.reads_per_epoch, signed),
            _of(cost.ops_per_micro_batch, cost.ops_per_micro_batch_count, signed, "the count"),
            _of(cost.ops_per_window, cost.ops_per_window_count, signed, "the count"),
            _signed(cost.ops_per_epoch, signed),
        ])
    return body


__all__ = [
    "ACCUMULATE", "DEVICES", "EPOCHS", "LOADERS", "TABLE_HEADERS", "WINDOWS_PER_EPOCH", "Cost", "CostCounter", "Row",
    "Tallies", "cost_data", "measure", "run", "summarize", "table_rows",
]
