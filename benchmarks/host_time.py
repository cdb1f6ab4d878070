"""Host time: what the strategy's Python adds to each optimizer step, in one process, against plain ``DDPStrategy``.

One process, world size 1: ``Trainer(accelerator="cpu", devices=1, strategy=...)`` with ``DDPStrategy(
process_group_backend="gloo")`` or ``TokenMeanDDPStrategy(mode=..., process_group_backend="gloo")`` still starts a
one-process gloo group in this process (the default ``"popen"`` launcher starts no child for one device) and wraps the
model in ``DistributedDataParallel``; every fit checks both. ``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=1``
(else Lightning's launcher sets ``cores // processes`` threads). After each fit the process group is destroyed, the
environment Lightning wrote (``MASTER_PORT``, ``WORLD_SIZE``, ...) restored and garbage collected, so fits run back to
back, each from a clean start. At world size 1 the package skips its record's all-reduce (``World.distributed`` is
False): what is measured is its host work alone, DDP's reducer and deferred's comm hook included.

Workload: the test suite's ``TokenModule`` (``TokenNet``, ``Linear(5,6)-tanh-Linear(6,7)``, float32, SGD with
momentum) on ``sft_batches("sft")`` (4 prompt-masked rows per micro-batch, ``labels`` with -100), a ``DataLoader``
with ``batch_size=None`` over pre-built batches (``tests/_harness.py``): the step is a millisecond or so of Python,
so every fixed cost shows. K = ``accumulate_grad_batches`` ∈ {1, 4}; one epoch holds (steps + 1)·K batches, so every
timed window is a mid-epoch one (lookahead reads the next window, as in steady state).

Timing, in lockstep pairs: a callback stamps ``time.perf_counter()`` and ``time.process_time()`` at the end of every
batch after which the optimizer stepped, inside the fit. Each repetition starts two child processes pinned to one CPU
(the CPUs alternate with the repetition; gloo's threads inherit the pin): one runs plain DDP's fits, the other
lookahead's, deferred's, the floor's (``FloorModule``: plain DDP with a ``training_step`` that scales its own loss by
its batch's count, the least an exact token mean adds), the floor with a window record (``RecordFloorModule``: the
window's loss sum read on the host once, the least a logged window loss adds to that) and plain's again (the control
pair), K = 1 then K = 4, each fit beside a plain one. The two fits of a pair take turns at every optimizer step
(``Baton``: a byte through a pipe), so exactly one of them runs at a time and each step is timed from its turn's start
to its end stamp; which side goes first alternates. The ratio of a pair is the method's timed steps over plain's (the
median single step's ratio beside it), and the table shows the median and min–max over repetitions. Why pairs in turns:
on this shared VM a fit's time per step swings by ±20-50 % between neighbouring fits of the same code (whole fits
compared one after the other gave medians that moved by ±0.1-0.2 between runs of this script), while the swings last
longer than a step or two and so hit both sides of a pair alike: the control pair's ratio stays within about ±2 % of 1.
What a turn costs (the other process ran in between: cooler caches) it costs both sides.

Profile (separate, untimed fits in this process after the timed pairs, 3 per method and K, interleaved; each cell
reports the fastest, least disturbed one, and the JSON keeps all three): ``cProfile`` runs from the end of the
warm-up steps to the end of the last step. A *package frame* is a function whose code lives under
``src/token_mean/``. The package's own host time is the time spent in package frames entered from outside the
package (Lightning's strategy hooks, its fetcher reading the reader, DDP's reducer calling deferred's comm hook, the
optimizer calling the step's closure), each counted with everything it calls, minus the *delegated* work plain DDP
does too: the calls from a package frame into the Lightning implementation it overrides (``super().training_step``,
``backward``, ``optimizer_step``, ...: the forward, backward and optimizer step themselves), into Lightning's
optimizer closure (which the strategy runs before the step) and into Lightning's ``CombinedLoader.__next__`` (which
the reader calls instead of the fetcher). Package frames inside delegated work (the comm hook during the backward)
are entries again. A call into a package frame made from package code through a non-package frame (a generator
context manager, ``any(...)`` over a generator expression) is nested, not an entry: an extra untimed fit per mode and
K under ``sys.setprofile`` classifies every call into a package frame from a non-package caller by its live stack,
and the profile's caller→callee edges are split by those counts, so nothing is counted twice. Formally, over the
profile's edges (cumulative time of a callee per caller): own = Σ ct(outside → package, entry) − Σ ct(package →
delegated). "Python" is the self time of package frames, "callees" the rest (torch ops, Lightning properties,
``enum``, ``pytree``: called from package frames, not delegated). Per window = own / profiled optimizer steps; per
micro-batch = own / (steps · K); fixed + per-micro-batch = the line through K = 1 and K = 4. The top functions are
ranked by self time per window, with their self time plus their direct non-delegated non-package callees beside it.
cProfile inflates host time (about 2× here, more for many small calls: compare the "mode − plain" columns of the
timed pairs and the profiled fits), so the profile's microseconds say *where* the time goes; the ratios come from the
un-profiled timed pairs. Plain DDP's profile holds no package frame (the timing callback calls no package code).

    .venv/bin/python benchmarks/host_time.py            # ~3 min on 2 cores -> benchmarks/results/host_time.{json,md}
    .venv/bin/python benchmarks/host_time.py --quick    # ~20 s: 40 steps, 1 repetition (temp folder)
    .venv/bin/python benchmarks/host_time.py --repetitions 10 --steps 500

Target (the issue): time per step ≤ 1.15 × plain DDP's at K = 1 and ≤ 1.10 × at K = 4, in both modes.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # before Lightning's launcher sets cores // processes torch threads

import lightning.pytorch as pl
import numpy
import torch
import torch.distributed as dist
from _common import (
    add_output_arguments,
    environment,
    environment_markdown,
    markdown_table,
    output_paths,
    quiet_lightning,
    write_results,
)
from _harness import METHODS, Batch, TokenModule, cast, sft_batches, train
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

import token_mean
from token_mean import IGNORE_INDEX, TokenMeanDDPStrategy

torch.set_num_threads(1)

ACCUMULATIONS = (1, 4)
FLOOR = "floor"  # plain DDP with FloorModule: the least an exact normalization adds (timed in pairs, not profiled)
RECORD_FLOOR = "floor_record"  # the floor and a minimal window record (RecordFloorModule)
PAIRED = (*METHODS[1:], FLOOR, RECORD_FLOOR, "plain")  # timed against plain DDP ("plain": the control pair)
# a package frame: code in a file under this folder (the package imported: run with PYTHONPATH=src to measure the
# checkout's own sources; the JSON records which folder it was)
PACKAGE = str(Path(token_mean.__file__).resolve().parent) + os.sep
Label = tuple[str, int, str]  # cProfile's key of a Python function: (file, first line, name)


@dataclass
class Settings:
    steps: int  # optimizer steps per fit (Trainer max_steps)
    warmup_steps: int  # the first steps, not timed (and not profiled)
    repetitions: int  # rounds of lockstep pairs (every method against plain, per K)
    profile_repetitions: int  # profiled fits per method and K; the fastest (least disturbed) one is reported


FULL = Settings(steps=200, warmup_steps=20, repetitions=6, profile_repetitions=3)  # a pair's ratio moves by ~1 %
# from one repetition to the next (the control pair says so): six pairs per cell, three on each CPU of two
QUICK = Settings(steps=40, warmup_steps=10, repetitions=1, profile_repetitions=1)
PAIR_TIMEOUT_S = 600  # a repetition's pairs (both children are killed past it; each also ends itself: alarm)


def cpu_seconds_busy() -> float | None:
    """Busy CPU seconds of the whole machine since boot (``/proc/stat``; None elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def make_strategy(method: str) -> Strategy:
    """Plain DDP or a mode, gloo, Lightning's default launcher (``strategy_for`` forks: a second process)."""
    if method == "plain":
        return DDPStrategy(process_group_backend="gloo")
    return TokenMeanDDPStrategy(mode=method, process_group_backend="gloo")


class FloorModule(TokenModule):
    """The least any exact token mean adds to plain DDP's step here: ``training_step`` scales its loss by its own
    batch's count, read with numpy from the CPU labels (one multiplication, and its backward). No sum over ranks
    (world size 1 needs none, and the package skips its record's all-reduce there too), no check, no record: what a
    user who hard-codes the normalization for one process would write. The scale's value does not matter here."""

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        count = int(numpy.count_nonzero(batch["labels"].numpy() != IGNORE_INDEX))
        self.counted(loss, float(count), batch_idx)
        return loss * (count / FLOOR_ITEMS)

    def counted(self, loss: Tensor, count: float, batch_idx: int) -> None:
        """The micro-batch at ``batch_idx`` had ``count`` items and ``loss`` (nothing more in the floor)."""


class RecordFloorModule(FloorModule):
    """The floor, and the least a window's record adds to it: each micro-batch's loss (detached) and count kept, and
    after the window's last forward their sum, Σ n·loss, in one stack, one copy to float64 and one product, read on
    the host once (what a logged window loss needs). No sum over ranks, no check, no stats object, no read-ahead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._losses: list[Tensor] = []
        self._counts: list[float] = []
        self.window_loss_sum = 0.0

    def counted(self, loss: Tensor, count: float, batch_idx: int) -> None:
        self._losses.append(loss.detach())
        self._counts.append(count)
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:  # no short last window here (make_data)
            weights = torch.tensor(self._counts, dtype=torch.float64)
            self.window_loss_sum = (torch.stack(self._losses).to(torch.float64) @ weights).item()
            self._losses.clear()
            self._counts.clear()


FLOOR_ITEMS = 16.0  # about a micro-batch's valid labels: the floor's loss scale stays near 1
FLOORS = {FLOOR: FloorModule, RECORD_FLOOR: RecordFloorModule}  # timed in pairs against plain DDP, not profiled


def make_data(steps: int, accumulate: int) -> list[list[Batch]]:
    """One rank's micro-batches: (steps + 1)·K, so the fit stops at max_steps in the middle of its epoch."""
    return cast(sft_batches("sft", 1, (steps + 1) * accumulate, seed=0), torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# one fit
# ---------------------------------------------------------------------------------------------------------------


class StepClock(Callback):
    """Stamps (wall, CPU) at the end of every batch after which the optimizer stepped; runs ``at_step(n)`` after the
    n-th step's stamp (the profile starts and stops there); checks the process group and the DDP wrapper. It calls no
    package code (``trainer.global_step`` tells a step, not ``token_mean._lightning``), so the profile of plain DDP
    holds no package frame and the modes' hold only the strategy's."""

    def __init__(self, at_step: Callable[[int], None] | None = None) -> None:
        self.stamps: list[tuple[float, float]] = []
        self.at_step = at_step
        self.setup: dict[str, Any] = {}
        self._step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.setup = {
            "process_group": dist.is_initialized(),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "world_size": dist.get_world_size() if dist.is_initialized() else None,
            "model": type(trainer.strategy.model).__name__,
            "torch_threads": torch.get_num_threads(),
        }
        expected = {"process_group": True, "backend": "gloo", "world_size": 1, "model": "DistributedDataParallel",
                    "torch_threads": 1}
        if self.setup != expected or not isinstance(trainer.strategy.model, DistributedDataParallel):
            raise RuntimeError(f"expected a one-process gloo group and a DDP-wrapped model, got {self.setup}")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != self._step:  # the optimizer stepped after this batch (no window here is empty)
            self._step = trainer.global_step
            self.stamps.append((time.perf_counter(), time.process_time()))
            if self.at_step is not None:
                self.at_step(len(self.stamps))


@contextmanager
def clean_fit() -> Iterator[None]:
    """Each fit from the same state: no process group, Lightning's environment variables gone, garbage collected."""
    env = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        gc.collect()  # the dropped DDP wrappers sit in cycles that hold the old group (token_mean/_exit.py)
        torch.set_num_threads(1)


def run_fit(method: str, accumulate: int, data: list[list[Batch]], settings: Settings,
            at_step: Callable[[int], None] | None = None) -> StepClock:
    clock = StepClock(at_step)
    module = FLOORS.get(method, TokenModule)(data, dtype=torch.float32, lr=0.1, momentum=0.9)
    with clean_fit():
        train(module, make_strategy("plain" if method in FLOORS else method), 1, callbacks=[clock],
              accumulate_grad_batches=accumulate, max_steps=settings.steps)
    if len(clock.stamps) != settings.steps:
        raise RuntimeError(f"{method} K={accumulate}: {settings.steps} steps expected, {len(clock.stamps)} ran")
    return clock


# ---------------------------------------------------------------------------------------------------------------
# timed pairs: two processes, plain DDP and a method, taking turns step by step on one CPU
# ---------------------------------------------------------------------------------------------------------------


class Baton:
    """One side of a lockstep pair (``StepClock.at_step``): at the end of each optimizer step, hand the CPU to the
    partner process and wait until it hands it back; each step is timed from that moment to its end stamp.

    Both fits run their first step at once (untimed); the side that is not ``first`` then waits for the first
    side's baton, so from the second step on exactly one of the two runs at a time, the other side's step n before
    the first side's: a swing of the shared machine that lasts longer than a step or two hits both sides alike. The
    first side runs the fit's last step and hands nothing back after it, so no baton is left over for the next
    fit."""

    def __init__(self, receive: int, send: int, first: bool, steps: int) -> None:
        self.receive, self.send, self.first, self.steps = receive, send, first, steps
        self.starts: list[tuple[float, float]] = []  # (wall, CPU) when the baton came back after step n

    def __call__(self, step: int) -> None:
        last = step == self.steps
        if (step > 1 or self.first) and not (last and self.first):
            os.write(self.send, b"x")
        if last:
            return
        if not os.read(self.receive, 1):
            raise RuntimeError("the partner process of this pair exited before its last step")
        self.starts.append((time.perf_counter(), time.process_time()))


@dataclass
class Pair:
    accumulate: int
    method: str  # the side measured against plain DDP ("plain" too: the control pair)
    repetition: int
    cpu: int  # the one CPU both processes were pinned to (-1: not pinned)
    plain_seconds: list[float]  # each timed step, wall
    mode_seconds: list[float]
    plain_cpu_seconds: float  # process CPU over the timed steps (every thread of the process, gloo's included)
    mode_cpu_seconds: float

    @property
    def ratio(self) -> float:
        return sum(self.mode_seconds) / sum(self.plain_seconds)

    @property
    def cpu_ratio(self) -> float:
        return self.mode_cpu_seconds / self.plain_cpu_seconds

    @property
    def median_step_ratio(self) -> float:
        return statistics.median(self.mode_seconds) / statistics.median(self.plain_seconds)

    def summary(self) -> dict[str, Any]:
        """What the JSON keeps of a pair (not every step's time: 400 floats a pair)."""
        return {"accumulate": self.accumulate, "method": self.method, "repetition": self.repetition, "cpu": self.cpu,
                "timed_steps": len(self.mode_seconds), "plain_seconds": sum(self.plain_seconds),
                "mode_seconds": sum(self.mode_seconds), "plain_median_step": statistics.median(self.plain_seconds),
                "mode_median_step": statistics.median(self.mode_seconds), "plain_cpu_seconds": self.plain_cpu_seconds,
                "mode_cpu_seconds": self.mode_cpu_seconds, "ratio": self.ratio}


def pair_fits(repetition: int) -> list[tuple[str, int, bool]]:
    """A repetition's fits, in order: (the method against plain, K, whether plain's side goes first)."""
    fits = [(method, accumulate) for accumulate in ACCUMULATIONS for method in PAIRED]
    return [(method, accumulate, (repetition + index) % 2 == 0) for index, (method, accumulate) in enumerate(fits)]


def pair_child(plain_side: bool, repetition: int, settings: Settings, receive: int, send: int, cpu: int) -> None:
    """One side of a repetition's pairs (``--pair-child``): its fits in turn with the partner's, their timed steps
    as JSON on stdout."""
    signal.alarm(PAIR_TIMEOUT_S)  # bounded even if the parent is gone and the partner waits for a turn forever
    if cpu >= 0:  # -1: --unpinned
        os.sched_setaffinity(0, {cpu})  # before any fit starts gloo's threads, which inherit it
    timed = []
    for method, accumulate, plain_first in pair_fits(repetition):
        baton = Baton(receive, send, plain_first == plain_side, settings.steps)
        clock = run_fit("plain" if plain_side else method, accumulate, make_data(settings.steps, accumulate),
                        settings, baton)
        # step n + 1 runs from the baton's return after step n to its own end stamp
        steps = [(end[0] - start[0], end[1] - start[1])
                 for start, end in zip(baton.starts, clock.stamps[1:], strict=True)]
        steps = steps[settings.warmup_steps - 1 :]  # steps warmup + 1 .. steps
        timed.append({"seconds": [wall for wall, _ in steps], "cpu": sum(cpu for _, cpu in steps)})
    print("PAIR " + json.dumps(timed), flush=True)


def timed_pairs(repetition: int, settings: Settings, cpu: int) -> list[Pair]:
    """A repetition: two child processes pinned to ``cpu``, one running plain DDP's fits, the other the methods'
    (``pair_fits``), each pair of fits taking turns step by step (``Baton``)."""
    to_mode, from_plain = os.pipe()
    to_plain, from_mode = os.pipe()
    children = []
    try:
        for plain_side, receive, send in ((True, to_plain, from_plain), (False, to_mode, from_mode)):
            children.append(subprocess.Popen(
                [sys.executable, __file__, "--pair-child", str(int(plain_side)), str(repetition), str(settings.steps),
                 str(settings.warmup_steps), str(receive), str(send), str(cpu)],
                pass_fds=(receive, send), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    finally:
        for fd in (to_mode, from_plain, to_plain, from_mode):
            os.close(fd)  # the children hold them now: one side's exit is the other's end of file
    results = []
    try:
        for child in children:
            out, err = child.communicate(timeout=PAIR_TIMEOUT_S)
            lines = [line for line in out.splitlines() if line.startswith("PAIR ")]
            if child.returncode != 0 or not lines:
                raise RuntimeError(f"a pair child exited {child.returncode}:\n{err[-3000:]}")
            results.append(json.loads(lines[-1][len("PAIR ") :]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return [Pair(accumulate, method, repetition, cpu, plain["seconds"], mode["seconds"], plain["cpu"], mode["cpu"])
            for (method, accumulate, _), plain, mode in zip(pair_fits(repetition), *results, strict=True)]


# ---------------------------------------------------------------------------------------------------------------
# the profile of the package's frames
# ---------------------------------------------------------------------------------------------------------------


def label(code: CodeType) -> Label:
    return code.co_filename, code.co_firstlineno, code.co_name


def is_package(key: Label | CodeType) -> bool:
    filename = key.co_filename if isinstance(key, CodeType) else key[0]
    return filename.startswith(PACKAGE)


def delegated_codes() -> set[Label]:
    """The non-package work a package frame calls that plain DDP runs too (module docstring): for every method the
    package's strategy classes define, the Lightning implementation it overrides (the next one in the MRO, which
    ``super()`` reaches); Lightning's optimizer closure; ``CombinedLoader.__next__``."""
    codes = {label(Closure.__call__.__code__), label(CombinedLoader.__next__.__code__)}
    mro = TokenMeanDDPStrategy.__mro__
    for index, cls in enumerate(mro):
        if not cls.__module__.startswith("token_mean"):
            continue
        for name, value in vars(cls).items():
            if not callable(value) or not hasattr(value, "__code__"):
                continue
            for parent in mro[index + 1 :]:
                inherited = vars(parent).get(name)
                if inherited is not None and not parent.__module__.startswith("token_mean"):
                    if hasattr(inherited, "__code__"):
                        codes.add(label(inherited.__code__))
                    break
    return codes


def qualified_names() -> dict[Label, str]:
    """``module.Class.method`` for every code object of the package (cProfile keeps only the bare name)."""
    names: dict[Label, str] = {}

    def walk(code: CodeType, module: str) -> None:
        names[label(code)] = f"{module}.{code.co_qualname}"
        for const in code.co_consts:
            if isinstance(const, CodeType):
                walk(const, module)

    for path in sorted(Path(PACKAGE).glob("*.py")):
        walk(compile(path.read_text(), str(path), "exec"), path.stem)
    return names


class EntryClassifier:
    """``sys.setprofile`` hook for an untimed fit: each call into a package frame from a non-package caller is an
    *entry* (no package frame above it, or a delegated call between) or *nested* (package code called it through
    non-package frames: a generator context manager, a builtin). Counted per (callee, caller); a C caller is
    ``"C"``, as cProfile's ``~`` entries cannot be named here."""

    def __init__(self, delegated: set[Label]) -> None:
        self.delegated = delegated
        self.counts: dict[tuple[Label, Label | str], list[int]] = defaultdict(lambda: [0, 0])  # [entry, nested]
        self._c_callers: list[FrameType] = []  # the frames of the C calls in progress

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            self._c_callers.append(frame)
        elif event in ("c_return", "c_exception"):
            if self._c_callers and self._c_callers[-1] is frame:
                self._c_callers.pop()
        elif event == "call" and is_package(frame.f_code):
            caller = frame.f_back
            through_c = bool(self._c_callers) and self._c_callers[-1] is caller
            if caller is not None and not through_c and is_package(caller.f_code):
                return  # package → package
            key = (label(frame.f_code), "C" if through_c or caller is None else label(caller.f_code))
            self.counts[key][1 if self._nested(caller) else 0] += 1

    def _nested(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if is_package(frame.f_code):
                return True
            if label(frame.f_code) in self.delegated and frame.f_back is not None and is_package(frame.f_back.f_code):
                return False
            frame = frame.f_back
        return False


@dataclass
class Profile:
    method: str
    accumulate: int
    windows: int  # profiled optimizer steps
    profiled_seconds_per_step: float  # wall per step under cProfile (its inflation)
    own_us_per_window: float = 0.0
    python_us_per_window: float = 0.0  # self time of package frames
    callees_us_per_window: float = 0.0  # non-package, non-delegated callees of package frames
    entries_us_per_window: dict[str, float] = field(default_factory=dict)  # by package function entered
    delegated_us_per_window: float = 0.0
    nested_us_per_window: float = 0.0  # entries into package frames found nested (not counted)
    unclassified_us_per_window: float = 0.0  # cProfile edges the classifier never saw (counted as entries)
    top_functions: list[dict[str, Any]] = field(default_factory=list)
    modules: dict[str, float] = field(default_factory=dict)  # self + direct callees per window, by file
    top_callees: list[dict[str, Any]] = field(default_factory=list)  # non-package callees of package frames
    # Lightning's and torch's work per window, package frames within included: the delegated calls grow too
    lightning_us_per_window: dict[str, float] = field(default_factory=dict)
    # Python-level calls per window that cProfile saw (every function, and those of package frames): unlike the
    # times, the same in every run of the same code, so they track the package's host work where timing is noise
    calls_per_window: float = 0.0
    package_calls_per_window: float = 0.0
    own_us_per_window_all: list[float] = field(default_factory=list)  # every profiled fit of this method and K
    profiled_seconds_per_step_all: list[float] = field(default_factory=list)


def lightning_functions() -> dict[str, Label]:
    """Work plain DDP and the modes both run, by its own cumulative time (whoever calls it)."""
    return {
        "Strategy.training_step": label(Strategy.training_step.__code__),
        "Strategy.backward": label(Strategy.backward.__code__),
        "autograd run_backward": ("~", 0, "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
        "CombinedLoader.__next__": label(CombinedLoader.__next__.__code__),
    }


def profiled_fit(method: str, accumulate: int, data: list[list[Batch]], settings: Settings) -> pstats.Stats:
    profiler = cProfile.Profile()

    def at_step(step: int) -> None:
        if step == settings.warmup_steps:
            profiler.enable()
        elif step == settings.steps:
            profiler.disable()

    clock = run_fit(method, accumulate, data, settings, at_step)
    stats = pstats.Stats(profiler)
    stats.wall_per_step = (  # type: ignore[attr-defined]
        (clock.stamps[-1][0] - clock.stamps[settings.warmup_steps - 1][0]) / (settings.steps - settings.warmup_steps)
    )
    return stats


def classified_fit(method: str, accumulate: int, data: list[list[Batch]], settings: Settings,
                   delegated: set[Label]) -> EntryClassifier:
    classifier = EntryClassifier(delegated)

    def at_step(step: int) -> None:
        if step == settings.warmup_steps:
            sys.setprofile(classifier)
        elif step == settings.steps:
            sys.setprofile(None)

    try:
        run_fit(method, accumulate, data, settings, at_step)
    finally:
        sys.setprofile(None)
    return classifier


def attribute(method: str, accumulate: int, stats: pstats.Stats, classifier: EntryClassifier | None,
              delegated: set[Label], names: dict[Label, str], windows: int) -> Profile:
    """The package's own host time from the profile's caller→callee edges (module docstring)."""
    raw: dict[Label, Any] = stats.stats  # type: ignore[attr-defined]
    per_window = 1e6 / windows
    profile = Profile(method, accumulate, windows, stats.wall_per_step)  # type: ignore[attr-defined]
    profile.calls_per_window = stats.total_calls / windows  # type: ignore[attr-defined]
    profile.package_calls_per_window = sum(calls for key, (_, calls, *_) in raw.items() if is_package(key)) / windows
    own = delegated_total = nested = unclassified = python = 0.0
    entries: dict[str, float] = defaultdict(float)
    for callee, (_, _, self_time, _, callers) in raw.items():
        if not is_package(callee):
            continue
        python += self_time
        for caller, (_, _, _, cumulative) in callers.items():
            if is_package(caller):
                continue
            group: Label | str = "C" if caller[0] == "~" else caller
            seen = classifier.counts.get((callee, group)) if classifier is not None else None
            if seen is None:
                share = 1.0
                unclassified += cumulative
            else:
                share = seen[0] / (seen[0] + seen[1])
            own += cumulative * share
            nested += cumulative * (1 - share)
            entries[names.get(callee, callee[2])] += cumulative * share
    # direct callees of package frames: delegated (subtracted) or the package's own (torch ops, properties, ...)
    by_function: dict[Label, float] = defaultdict(float)
    callees: dict[Label, float] = defaultdict(float)
    for callee, (_, _, _, _, callers) in raw.items():
        if is_package(callee):
            continue
        for caller, (_, _, _, cumulative) in callers.items():
            if not is_package(caller):
                continue
            if callee in delegated:
                delegated_total += cumulative
            else:
                by_function[caller] += cumulative
                callees[callee] += cumulative
    own -= delegated_total
    profile.own_us_per_window = own * per_window
    profile.python_us_per_window = python * per_window
    profile.callees_us_per_window = (own - python) * per_window
    profile.delegated_us_per_window = delegated_total * per_window
    profile.nested_us_per_window = nested * per_window
    profile.unclassified_us_per_window = unclassified * per_window
    profile.entries_us_per_window = {
        name: value * per_window for name, value in sorted(entries.items(), key=lambda item: -item[1]) if value > 0
    }
    functions = []
    modules: dict[str, float] = defaultdict(float)
    for key, (_, calls, self_time, _, _) in raw.items():
        if not is_package(key):
            continue
        with_callees = self_time + by_function.get(key, 0.0)
        modules[Path(key[0]).name] += with_callees * per_window
        functions.append({
            "function": names.get(key, key[2]), "file": Path(key[0]).name, "line": key[1],
            "calls_per_window": calls / windows, "self_us_per_window": self_time * per_window,
            "self_and_callees_us_per_window": with_callees * per_window,
        })
    functions.sort(key=lambda f: -f["self_us_per_window"])
    profile.top_functions = functions[:15]
    profile.modules = dict(sorted(modules.items(), key=lambda item: -item[1]))
    profile.lightning_us_per_window = {
        name: raw[key][3] * per_window if key in raw else 0.0 for name, key in lightning_functions().items()
    }
    profile.top_callees = [
        {"callee": callee_name(key), "us_per_window": value * per_window,
         "calls_per_window": raw[key][1] / windows}
        for key, value in sorted(callees.items(), key=lambda item: -item[1])[:10]
    ]
    return profile


def profile_all(settings: Settings, datasets: dict[int, list[list[Batch]]]) -> list[Profile]:
    delegated = delegated_codes()
    names = qualified_names()
    windows = settings.steps - settings.warmup_steps
    classifiers = {
        (method, accumulate): classified_fit(method, accumulate, datasets[accumulate], settings, delegated)
        for accumulate in ACCUMULATIONS for method in METHODS[1:]
    }
    every: dict[tuple[str, int], list[Profile]] = defaultdict(list)
    for _ in range(settings.profile_repetitions):  # interleaved: drift hits every method alike
        for accumulate in ACCUMULATIONS:
            for method in METHODS:
                stats = profiled_fit(method, accumulate, datasets[accumulate], settings)
                every[(method, accumulate)].append(attribute(method, accumulate, stats, classifiers.get(
                    (method, accumulate)), delegated, names, windows))
    profiles = []
    for repeats in every.values():
        # other load only slows a fit down: the fastest profiled fit is the least disturbed one
        best = min(repeats, key=lambda p: p.profiled_seconds_per_step)
        best.own_us_per_window_all = [p.own_us_per_window for p in repeats]
        best.profiled_seconds_per_step_all = [p.profiled_seconds_per_step for p in repeats]
        profiles.append(best)
    return profiles


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------


def summarize(pairs: list[Pair]) -> list[dict[str, Any]]:
    """Per K and method: the pairs' ratios (the method's side over plain's), median and range over repetitions."""
    rows = []
    for accumulate in ACCUMULATIONS:
        for method in PAIRED:
            mine = [p for p in pairs if p.accumulate == accumulate and p.method == method]
            ratios = [p.ratio for p in mine]
            cpu_ratios = [p.cpu_ratio for p in mine]
            step_ratios = [p.median_step_ratio for p in mine]
            mode_ms = [statistics.fmean(p.mode_seconds) * 1e3 for p in mine]
            plain_ms = [statistics.fmean(p.plain_seconds) * 1e3 for p in mine]
            rows.append({
                "accumulate": accumulate, "method": method,
                "ms_per_step": statistics.median(mode_ms), "ms_per_step_min": min(mode_ms),
                "ms_per_step_max": max(mode_ms), "plain_ms_per_step": statistics.median(plain_ms),
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "ratios": ratios, "cpu_ratio_median": statistics.median(cpu_ratios),
                "cpu_ratio_min": min(cpu_ratios), "cpu_ratio_max": max(cpu_ratios),
                "median_step_ratio_median": statistics.median(step_ratios),
                "median_step_ratio_min": min(step_ratios), "median_step_ratio_max": max(step_ratios),
                "extra_us_per_step_median": statistics.median(
                    m - q for m, q in zip(mode_ms, plain_ms, strict=True)) * 1e3,
            })
    return rows


def linear_split(profiles: list[Profile]) -> dict[str, dict[str, float]]:
    """Per mode: own host time = fixed per window + per micro-batch × K, through K = 1 and K = 4."""
    low, high = min(ACCUMULATIONS), max(ACCUMULATIONS)
    split = {}
    for method in METHODS[1:]:
        own = {p.accumulate: p.own_us_per_window for p in profiles if p.method == method}
        per_micro_batch = (own[high] - own[low]) / (high - low)
        split[method] = {"fixed_us_per_window": own[low] - per_micro_batch * low,
                         "us_per_micro_batch": per_micro_batch}
    return split


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def callee_name(key: Label) -> str:
    """cProfile's name of a callee, its file relative to site-packages or the standard library."""
    if key[0] == "~":
        return key[2]
    return f"{re.sub(r'.*/(site-packages|lib/python3[.][0-9]+)/', '', key[0])}:{key[1]}({key[2]})"


LABELS = {"plain": "plain (control pair)", FLOOR: "floor (a count and a scale)",
          RECORD_FLOOR: "floor + record (and a window sum read)"}


def report(settings: Settings, env: dict[str, Any], rows: list[dict[str, Any]], profiles: list[Profile],
           split: dict[str, dict[str, float]], load_after: list[float], other_cores: float | None) -> str:
    timing_headers = ["K", "method (vs plain)", "ms/step: plain → method (median)", "ratio (median)", "min–max",
                      "CPU ratio", "median-step ratio (min–max)"]
    timing = []
    for accumulate in ACCUMULATIONS:
        for method in PAIRED:
            r = next(r for r in rows if r["accumulate"] == accumulate and r["method"] == method)
            timing.append([
                accumulate, LABELS.get(method, method),
                f"{r['plain_ms_per_step']:.3f} → {r['ms_per_step']:.3f}", f"**{r['ratio_median']:.3f}**",
                f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f}", f"{r['cpu_ratio_median']:.3f}",
                f"{r['median_step_ratio_median']:.3f} ({r['median_step_ratio_min']:.3f}–"
                f"{r['median_step_ratio_max']:.3f})",
            ])
    by_key = {(p.method, p.accumulate): p for p in profiles}
    profile_rows = []
    for p in profiles:
        if p.method == "plain":
            continue
        plain_profiled = by_key[("plain", p.accumulate)].profiled_seconds_per_step
        timed = next(r for r in rows if r["accumulate"] == p.accumulate and r["method"] == p.method)
        hook = sum(v for k, v in p.entries_us_per_window.items() if k.startswith("_comm_hook."))
        profile_rows.append([
            p.method, p.accumulate, f"{timed['extra_us_per_step_median']:.0f}",
            f"{(p.profiled_seconds_per_step - plain_profiled) * 1e6:.0f}",
            f"**{p.own_us_per_window:.0f}**", f"{p.own_us_per_window / p.accumulate:.0f}",
            f"{p.python_us_per_window:.0f}", f"{p.callees_us_per_window:.0f}", f"{hook:.0f}",
            f"{split[p.method]['fixed_us_per_window']:.0f} + {split[p.method]['us_per_micro_batch']:.0f}·K",
            f"+{p.calls_per_window - by_key[('plain', p.accumulate)].calls_per_window:.0f}"
            f" ({p.package_calls_per_window:.0f})",
        ])
    profile_headers = ["mode", "K", "timed: mode − plain µs/step (median)", "profiled: mode − plain",
                       "own µs/window", "own µs/micro-batch", "of which Python (self)", "callees",
                       "comm hook (incl.)", "fit: fixed + per micro-batch",
                       "Python calls / window vs plain (package frames)"]
    callee_names = list(dict.fromkeys(c["callee"] for p in profiles if p.method != "plain" for c in p.top_callees[:6]))
    module_names = list(dict.fromkeys(name for p in profiles for name in p.modules))
    modes = [p for p in profiles if p.method != "plain"]
    module_rows = [[name, *(f"{p.modules.get(name, 0.0):.0f}" for p in modes)] for name in module_names
                   if max(p.modules.get(name, 0.0) for p in modes) >= 1.0]
    module_headers = ["file (self + direct callees, µs/window)", *(f"{p.method} K={p.accumulate}" for p in modes)]
    callee_rows = [[f"`{short(name)}`", *(
        f"{next((c['us_per_window'] for c in p.top_callees if c['callee'] == name), 0.0):.0f}" for p in modes)]
        for name in callee_names]
    callee_headers = ["non-package callee of package frames (µs/window)", *(f"{p.method} K={p.accumulate}"
                                                                            for p in modes)]
    lightning_rows = [
        [name, *(f"{by_key[('plain', p.accumulate)].lightning_us_per_window[name]:.0f} →"
                 f" {p.lightning_us_per_window[name]:.0f}" for p in modes)]
        for name in lightning_functions()
    ]
    lightning_headers = ["Lightning / torch, cumulative µs/window: plain → mode", *(f"{p.method} K={p.accumulate}"
                                                                                   for p in modes)]
    sections = [
        "### Host time: seconds per optimizer step against plain DDPStrategy (one process, world size 1, gloo)",
        environment_markdown(env) + f" · load average {load_after[0]:.1f} at the end"
        + ("" if other_cores is None else f" · other processes used {other_cores:.2f} cores on average meanwhile"),
        f"{settings.repetitions} repetitions of lockstep pairs per K: plain DDP and the method in two processes"
        + (" on every CPU (unpinned)" if env["configuration"]["unpinned"] else
           " pinned to one CPU (the CPUs alternate with the repetition)") + ", one fit each of"
        f" {settings.steps} optimizer steps, taking turns step by step; the steps after the {settings.warmup_steps}"
        " warm-up steps timed, each from its turn's start to its end. Ratio = the method's timed steps / plain's in"
        " the same pair; the control pair runs plain against plain (what the measure itself shows for no"
        " difference); the floor is plain DDP with a training_step that scales its loss by its batch's count, read"
        " with numpy (one multiplication and its backward; no sum over ranks, no check): the least an exact token mean"
        " adds to this step; floor + record adds what a window's loss sum needs (each micro-batch's loss kept, after"
        " the window's last forward one stack, one float64 copy and one product with the counts, read on the host"
        " once); CPU ratio the same for process CPU time; median-step ratio the same for the median single"
        " step. Target: ≤ 1.15 at K = 1, ≤ 1.10 at K = 4.",
        markdown_table(timing_headers, timing),
        f"Profile (cProfile, separate fits of the same {settings.steps} steps, profiled after the warm-up; the fastest"
        f" of {settings.profile_repetitions} per cell): the"
        " package's own host time = time in package frames entered from outside the package, with their callees,"
        " minus the delegated work plain DDP does too (Lightning's training_step, backward, optimizer step and"
        " closure, the loader's next); Python = self time of package frames; callees = torch ops and other"
        " non-package calls they make; comm hook = deferred's DDP hook with the bucket all-reduce it issues. cProfile"
        " inflates these (compare the timed and profiled mode − plain columns): read them as shares. The calls are"
        " exact counts (the same in every run of the same code): the Python-level calls per window the mode adds to"
        " plain DDP's, and how many of them are package frames.",
        markdown_table(profile_headers, profile_rows),
        markdown_table(module_headers, module_rows),
        markdown_table(callee_headers, callee_rows),
        "What the package makes the delegated work do, outside its own frames (the loss scale's autograd nodes in"
        " the backward, deferred's Python comm hook dispatched from DDP's reducer, whose time the comm hook column"
        " counts as the package's): the same Lightning and torch functions in the profiled plain and mode fits. The"
        " profiled mode − plain minus the package's own time is this and the noise of single fits.",
        markdown_table(lightning_headers, lightning_rows),
    ]
    for method in METHODS[1:]:
        mine = [p for p in profiles if p.method == method]
        top_names = list(dict.fromkeys(f["function"] for p in mine for f in p.top_functions[:10]))
        table_rows = []
        for name in top_names:
            cells: list[Any] = [f"`{short(name)}`"]
            for p in mine:
                f = next((f for f in p.top_functions if f["function"] == name), None)
                cells += ["–"] * 3 if f is None else [
                    f"{f['calls_per_window']:.3g}", f"{f['self_us_per_window']:.1f}",
                    f"{f['self_and_callees_us_per_window']:.1f}"]
            table_rows.append(cells)
        headers = [f"{method}: top functions by self time"]
        for p in mine:
            headers += [f"K={p.accumulate} calls/window", "self µs/window", "+ callees"]
        sections.append(markdown_table(headers, table_rows))
    return "\n\n".join(sections)


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have exited (the pairs' fits)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    if sys.argv[1:2] == ["--pair-child"]:  # one side of a timed pair (timed_pair)
        plain_side, repetition, steps, warmup, receive, send, cpu = (int(value) for value in sys.argv[2:9])
        quiet_lightning()
        pair_child(bool(plain_side), repetition, Settings(steps, warmup, 1, 1), receive, send, cpu)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "host_time")  # --quick: 40 steps, 1 repetition, temp folder
    parser.add_argument("--repetitions", type=int, help="repetitions of the lockstep pairs (default 6; quick: 1)")
    parser.add_argument("--steps", type=int, help="optimizer steps per fit (default 200; quick: 40)")
    parser.add_argument("--unpinned", action="store_true",
                        help="leave the pairs' processes on every CPU (the default pins both sides to one)")
    parser.add_argument("--profile-repetitions", type=int,
                        help="profiled fits per method and K, the fastest reported (default 3; quick: 1)")
    args = parser.parse_args()
    json_path, markdown_path = output_paths(args, "host_time")
    quiet_lightning()
    settings = QUICK if args.quick else FULL
    settings = Settings(args.steps or settings.steps, settings.warmup_steps, args.repetitions or settings.repetitions,
                        args.profile_repetitions or settings.profile_repetitions)
    if settings.steps <= settings.warmup_steps:
        parser.error(f"--steps must exceed the {settings.warmup_steps} warm-up steps")
    # where the OS cannot pin a process (macOS), the pairs run unpinned, as with --unpinned (the JSON says so)
    unpinned = args.unpinned or not hasattr(os, "sched_setaffinity")
    env = environment({
        **asdict(settings), "accumulations": list(ACCUMULATIONS), "methods": list(METHODS),
        "process": "one process, Trainer(accelerator='cpu', devices=1), world size 1, gloo, Lightning's default"
                   " launcher (no child process), OMP_NUM_THREADS=1",
        "model": "tests/_harness.py TokenModule: TokenNet Linear(5,6)-tanh-Linear(6,7), float32, SGD(lr=0.1,"
                 " momentum=0.9)",
        "data": "sft_batches('sft', 1 rank, (steps + 1)·K, seed=0) in float32, DataLoader(batch_size=None)",
        "timing": "lockstep pairs (plain and the method, two processes pinned to one CPU, taking turns each"
                  " optimizer step); each timed step from its turn's start to its end (perf_counter, process_time);"
                  " ratio = the method's timed steps / plain's in the same pair",
        "profile": "cProfile from the end of the warm-up to the last step, separate fits; package frames: code under"
                   " src/token_mean/; own = entries from outside minus delegated parent work (module docstring)",
        "package": PACKAGE,
        "quick": args.quick,
        "unpinned": unpinned,
    })
    started, busy_before, own_before = time.perf_counter(), cpu_seconds_busy(), own_cpu_seconds()
    datasets = {accumulate: make_data(settings.steps, accumulate) for accumulate in ACCUMULATIONS}
    cpus = [-1] if unpinned else sorted(os.sched_getaffinity(0))
    pairs: list[Pair] = []
    for repetition in range(settings.repetitions):
        cpu = cpus[repetition % len(cpus)]
        pairs += timed_pairs(repetition, settings, cpu)  # with a plain pair: the control
        print(f"repetition {repetition + 1}/{settings.repetitions} done ({time.perf_counter() - started:.0f} s)",
              flush=True)
    profiles = profile_all(settings, datasets)
    load_after = [round(value, 2) for value in os.getloadavg()]
    busy_after = cpu_seconds_busy()
    # other processes' CPU while this ran, in cores (0: the machine was this run's alone; 1: one core busy with others)
    other_cores = None if busy_before is None or busy_after is None else round(
        max(busy_after - busy_before - (own_cpu_seconds() - own_before), 0.0) / (time.perf_counter() - started), 2)
    rows = summarize(pairs)
    split = linear_split(profiles)
    ratios = {f"ratio_{r['method']}_K{r['accumulate']}": r["ratio_median"] for r in rows if r["method"] != "plain"}
    payload = {
        **ratios, "target": {"K1": 1.15, "K4": 1.10}, "environment": env, "load_average_after": load_after,
        "other_processes_cores": other_cores,
        "rows": rows, "profile": [asdict(p) for p in profiles], "profile_linear_split": split,
        "pairs": [p.summary() for p in pairs],
    }
    markdown = report(settings, env, rows, profiles, split, load_after, other_cores)
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
