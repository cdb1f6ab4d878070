"""Where a fit's synchronizing CUDA operations fall against its accumulation windows: a callback for one fit.

Shared by the GPU lane (``tests/scripts/gpu_token_mean.py``, read by ``tests/test_gpu.py``) and the GPU benchmark
(``benchmarks/gpu_step.py``). From ``on_train_start`` to ``on_train_end``, ``torch.cuda.set_sync_debug_mode("warn")``
makes every synchronizing CUDA operation warn, and :class:`SyncWatch` files each warning, with the innermost frame
outside torch as its origin (``token_mean``, ``lightning`` or ``other``) and its stack, under one of three stages:

- ``inside``: between a window's first forward (``LightningModule.training_step`` with gradient) and the end of its
  last backward (``LightningModule.backward``), with its phase: ``step`` inside the strategy's ``training_step`` and
  ``backward``, ``between`` in Lightning's loop between micro-batches. On a GPU a read here stalls the device
  before a backward is queued.
- ``count_check``: inside the package's count check (``token_mean._audit.FirstWindowCheck.ended``, which the
  strategy's ``optimizer_step`` runs after the fit's first window's last backward and before its update);
- ``outside``: anything else, filed after the last window that ended (-1: before the first): the strategy's read of
  a window's record after its last backward, the optimizer step, the loop, the next batch.

Every sync also carries ``steps``: the optimizer steps begun before it (``on_before_optimizer_step`` calls), so
"after window w's last backward, before its optimizer step" is ``window == w and steps == w``. A ``training_step``
without gradient is a replay (the count check's, three per micro-batch), filed in ``replays``, never as a micro-batch.

Sync debug mode is process-wide, so the autograd engine's device threads (the backward, DDP's comm hook) are watched
too; their warnings reach ``warnings.showwarning`` in the thread that issued them.

``rehearse=True`` (no CUDA): nothing synchronizes on the CPU, so a dispatch mode warns the same message where a CUDA
tensor would synchronize: ``aten._local_scalar_dense`` (``item()``, ``float()``, ``int()``, ``bool()``),
``aten.nonzero`` and ``Tensor.tolist``. The bookkeeping then runs on the CPU as it would on a GPU. Reads of tensors
that stay on the host on a GPU are counted too, except lookahead's counts of the batches the loader yielded, read
ahead (``token_mean._counts.read_count``: a loader's batch is moved to the device only as the loop takes it).
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

import token_mean
import token_mean._audit
import token_mean._counts
from token_mean import _lightning

SYNC = "called a synchronizing CUDA operation"
STAGES = ("inside", "count_check", "outside")
COUNT_CHECK = "ended"  # token_mean._audit.FirstWindowCheck's method: the first window's count check, before the update
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TOKEN_MEAN_DIR = os.path.dirname(token_mean.__file__) + os.sep
_LIGHTNING_DIR = os.path.dirname(lightning.__file__) + os.sep
_SKIPPED = (warnings.__file__, __file__)  # the warning machinery, and this file's wrappers and rehearsal


def origin_of(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """Who issued the operation: the innermost frame outside torch (and the warning machinery and this file), as an
    origin and ``file:line in function`` (relative to its package)."""
    for frame in reversed(stack):
        if frame.filename in _SKIPPED or frame.filename.startswith(_TORCH_DIR):
            continue
        for origin, directory in (("token_mean", _TOKEN_MEAN_DIR), ("lightning", _LIGHTNING_DIR)):
            if frame.filename.startswith(directory):
                return origin, f"{origin}/{frame.filename[len(directory):]}:{frame.lineno} in {frame.name}"
        return "other", f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return "other", "?"


_HOST_COUNT = token_mean._counts.read_count.__code__  # counts a batch as the loader yielded it: on the host on a GPU


def _counts_a_host_batch() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _HOST_COUNT:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Rehearsal(TorchDispatchMode):
    """On the CPU: warn as CUDA's sync debug mode would where the tensor were on a GPU."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        read = func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero)
        if read and not _counts_a_host_batch():
            warnings.warn(f"{SYNC} (rehearsed on the CPU: {func.overloadpacket.__name__})", stacklevel=2)
        return func(*args, **(kwargs or {}))


class SyncWatch(Callback):
    """Files every synchronizing CUDA operation of one fit (module docstring); :meth:`record` returns what it saw:
    ``window_lengths`` (micro-batches with gradient per window), ``syncs``, ``replays`` and ``count_checks`` (one
    entry per call of the count check: the window after which it ran, the optimizer steps begun, its replays and
    its syncs)."""

    def __init__(self, rehearse: bool = False) -> None:
        self.rehearse = rehearse
        self.window_lengths: list[int] = []
        self.syncs: list[dict[str, Any]] = []
        self.replays: list[dict[str, Any]] = []
        self.count_checks: list[dict[str, Any]] = []
        self._window: int | None = None  # the open window: its first forward ran, its last backward has not ended
        self._ended = -1  # the last window whose last backward ended
        self._steps = 0
        self._phase = "between"
        self._closes = False  # the micro-batch in flight is its window's last
        self._check: dict[str, Any] | None = None  # the count check in progress
        self._restore: list[Callable[[], None]] = []
        self._show_previous: Callable[..., Any] | None = None
        self._rehearsal: _Rehearsal | None = None

    # ------------------------------------------------------------------------------------------------ recording

    def _show(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if not str(message).startswith(SYNC):
            if self._show_previous is not None:
                self._show_previous(message, category, filename, lineno, *rest)
            return
        stack = traceback.extract_stack()[:-1]  # without this frame
        origin, where = origin_of(stack)
        if self._window is not None:
            stage, window, phase = "inside", self._window, self._phase
        else:
            stage, window, phase = ("outside" if self._check is None else "count_check"), self._ended, ""
        if self._check is not None and stage == "count_check":
            self._check["syncs"] += 1
        kept = [frame for frame in stack if frame.filename not in _SKIPPED][-13:]
        self.syncs.append({
            "stage": stage, "window": window, "phase": phase, "steps": self._steps, "origin": origin,
            "where": where, "stack": "".join(traceback.format_list(kept)),
        })

    def _begin_micro_batch(self, trainer: pl.Trainer) -> None:
        self._closes = _lightning.steps_after_this_batch(trainer)
        self._phase = "step"

    def _forward(self) -> None:
        if not torch.is_grad_enabled():  # a replay without gradient (the count check's): not a micro-batch
            checking = self._check is not None
            self.replays.append({"window": self._ended, "steps": self._steps, "in_count_check": checking})
            if self._check is not None:
                self._check["replays"] += 1
            return
        if self._window is None:
            self._window = len(self.window_lengths)
            self.window_lengths.append(0)
        self.window_lengths[self._window] += 1

    def _forward_done(self) -> None:
        self._phase = "between"

    def _backward_done(self) -> None:
        self._phase = "between"
        if self._closes and self._window is not None:
            self._ended, self._window = self._window, None

    def _count_check(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            self._check = {"window": self._ended, "steps": self._steps, "replays": 0, "syncs": 0}
            try:
                return original(*args, **kwargs)
            finally:
                self.count_checks.append(self._check)
                self._check = None

        return watched

    def record(self) -> dict[str, Any]:
        return {
            "window_lengths": self.window_lengths, "syncs": self.syncs, "replays": self.replays,
            "count_checks": self.count_checks,
        }

    # ------------------------------------------------------------------------------------------------ the fit's hooks

    def _wrap(self, owner: Any, name: str, before: Callable[[], None] | None, after: Callable[[], None] | None) -> None:
        """``owner.name`` (an instance's method) runs ``before`` and ``after`` around itself until the fit ends."""
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
        self._restore.append(lambda: owner.__dict__.pop(name, None))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        self._wrap(strategy, "training_step", lambda: self._begin_micro_batch(trainer), self._forward_done)
        # the window opens at its first forward: lookahead counts an epoch's first window before it, as documented
        self._wrap(pl_module, "training_step", self._forward, None)
        self._wrap(strategy, "backward", lambda: setattr(self, "_phase", "step"), None)
        # ... and ends with the backward itself: the strategy's `backward` reads the window's record after it
        self._wrap(pl_module, "backward", None, self._backward_done)
        check = token_mean._audit.FirstWindowCheck
        original = check.__dict__.get(COUNT_CHECK)
        if original is None:  # a rename would otherwise hide the check's reads among the others
            raise RuntimeError(f"FirstWindowCheck.{COUNT_CHECK} is gone: tests/_sync.py must find the count check")
        setattr(check, COUNT_CHECK, self._count_check(original))
        self._restore.append(lambda: setattr(check, COUNT_CHECK, original))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warnings.filterwarnings("always", message=SYNC)
        self._show_previous, warnings.showwarning = warnings.showwarning, self._show
        if self.rehearse:
            self._rehearsal = _Rehearsal()
            self._rehearsal.__enter__()
            tolist = torch.Tensor.tolist

            def rehearsed_tolist(tensor: torch.Tensor) -> Any:
                warnings.warn(f"{SYNC} (rehearsed on the CPU: tolist)", stacklevel=2)
                return tolist(tensor)

            torch.Tensor.tolist = rehearsed_tolist  # type: ignore[method-assign,assignment]
            self._restore.append(lambda: setattr(torch.Tensor, "tolist", tolist))
        else:
            torch.cuda.set_sync_debug_mode("warn")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._steps += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        """Everything as it was (idempotent: ``on_train_end``, and ``teardown`` after a fit that raised)."""
        if self._rehearsal is not None:
            self._rehearsal.__exit__(None, None, None)
            self._rehearsal = None
        elif torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        if self._show_previous is not None:
            warnings.showwarning, self._show_previous = self._show_previous, None
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


# ---------------------------------------------------------------------------------------------------------------
# reading a record
# ---------------------------------------------------------------------------------------------------------------


def place(sync: dict[str, Any]) -> str:
    """Where a sync falls in words (module docstring)."""
    if sync["stage"] == "inside":
        return "inside a window (first forward to last backward)"
    if sync["stage"] == "count_check":
        return "in the count check (after the first window's last backward, before its optimizer step)"
    if sync["window"] < 0:
        return "before the first window"
    if sync["steps"] <= sync["window"]:
        return "after the window's last backward, before its optimizer step"
    return "after the window's optimizer step began (the step, the loop, the next batch)"


def per_window(record: dict[str, Any], first: int, origin: str | None = "token_mean") -> dict[str, Any]:
    """``origin``'s syncs (None: everyone's) of the windows from ``first`` on (inside each and after it, until the
    next one opens), per window, by place and by ``where``; the count check's apart, in ``count_checks``."""
    windows = len(record["window_lengths"]) - first
    mine = [
        s
        for s in record["syncs"]
        if (origin is None or s["origin"] == origin) and s["window"] >= first and s["stage"] != "count_check"
    ]
    by_place = collections.Counter(place(s) for s in mine)
    by_where = collections.Counter(f"{s['where']} ({place(s)})" for s in mine)
    return {
        "origin": origin or "all", "windows": windows,
        "per_window": len(mine) / windows if windows > 0 else None,
        "per_window_by_place": {k: v / windows for k, v in sorted(by_place.items())} if windows > 0 else {},
        "per_window_by_where": {k: v / windows for k, v in sorted(by_where.items())} if windows > 0 else {},
        "count_checks": record["count_checks"],
    }


__all__ = ["COUNT_CHECK", "STAGES", "SYNC", "SyncWatch", "origin_of", "per_window", "place"]
