"""What a monitor does with each window, under the Trainer (``DenominatorMonitor``) or Fabric (``FabricMonitor``).

:class:`Observer` takes a window's :class:`~token_mean.WindowStats` and the step's fingerprints and gives back the
metrics to log; it writes the trace (``_trace``) and compares it with a reference (``_compare``), raising, warning or
logging at the first divergent step. It knows neither Lightning's loop nor Fabric's: the two monitors only say when a
window ended, and log what it returns.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from token_mean._compare import TraceComparison
from token_mean._trace import TraceWriter, trace_format
from token_mean.errors import DivergenceError
from token_mean.results import Divergence, WindowStats

OnDivergence = Literal["warn", "raise", "log"]
TraceValue = float | int | None


@dataclass(frozen=True)
class MonitorSettings:
    """A monitor's settings, checked once (:meth:`checked`)."""

    logging_interval: int | None
    prefix: str
    record: str | os.PathLike[str] | None
    reference: str | os.PathLike[str] | None
    rtol: float
    atol: float
    on_divergence: OnDivergence
    monitor: str  # the front end's monitor class, named in messages

    @staticmethod
    def checked(
        logging_interval: object,
        prefix: object,
        record: str | os.PathLike[str] | None,
        reference: str | os.PathLike[str] | None,
        rtol: object,
        atol: object,
        on_divergence: object,
        interval_default: str,
        monitor: str,
    ) -> MonitorSettings:
        """The settings, or an error naming the argument, its value and the fix."""
        if logging_interval is not None and (
            isinstance(logging_interval, bool) or not isinstance(logging_interval, int) or logging_interval < 1
        ):
            raise ValueError(
                f"`logging_interval` must be a positive int (optimizer steps) or None to follow {interval_default},"
                f" got {logging_interval!r}."
            )
        if not isinstance(prefix, str):
            raise TypeError(f"`prefix` must be a str such as 'denominator', got {type(prefix).__name__}: {prefix!r}.")
        for name, tolerance in (("rtol", rtol), ("atol", atol)):
            if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
                raise ValueError(f"`{name}` must be a number >= 0, got {tolerance!r}.")
        if on_divergence not in ("warn", "raise", "log"):
            raise ValueError(f"`on_divergence` must be 'warn', 'raise' or 'log', got {on_divergence!r}.")
        if record is not None:
            trace_format(record, "record")
        if reference is not None:
            trace_format(reference, "reference")
        if record is not None and reference is not None and Path(record).resolve() == Path(reference).resolve():
            raise ValueError(
                f"`record` and `reference` are the same file, {os.fspath(record)!r}: recording would overwrite the"
                " reference before it is read. Record to another path."
            )
        prefix = f"{prefix}/" if prefix and not prefix.endswith("/") else prefix
        return MonitorSettings(
            logging_interval, prefix, record, reference, float(rtol), float(atol), on_divergence,  # type: ignore[arg-type]
            monitor,
        )


class Observer:
    """One run's trace, comparison and metrics (see the module docstring).

    Every rank compares (the numbers are the same on every rank, so with ``on_divergence="raise"`` all ranks raise
    together and none is left waiting in a collective); only rank zero writes the trace.
    """

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        self.first_divergence: Divergence | None = None
        self._reference = None if settings.reference is None else TraceComparison(
            settings.reference, settings.rtol, settings.atol, settings.monitor
        )
        self._writer: TraceWriter | None = None
        self._warned_past_reference = False

    @property
    def fingerprints(self) -> bool:
        """Whether the steps' gradient and parameter norms are needed (a trace is written or compared), on every rank:
        the norm of a sharded model is a collective."""
        return self.settings.record is not None or self._reference is not None

    def start(self, writes: bool, first_step: int, total_steps: float) -> None:
        """A run starts at ``first_step`` and takes ``total_steps`` (``inf``: unknown); ``writes``: rank zero."""
        self.first_divergence = None
        self._warned_past_reference = False
        if self._reference is not None:
            self._reference.check_length(first_step, total_steps)
        if self.settings.record is not None and writes:
            self._writer = TraceWriter(self.settings.record)

    def window(
        self,
        step: int,
        stats: WindowStats,
        elapsed: float,
        norms: tuple[Tensor | None, Tensor | None] = (None, None),
        naive_loss: float | None = None,
        audit_error: float | None = None,
    ) -> tuple[dict[str, float], bool]:
        """A window ended at ``step``: its metrics (prefixed) and whether a divergence asks to log them now.

        ``norms`` are the step's gradient norm (before clipping) and parameter norm (after the update), on the device:
        read here in one device-to-host copy. ``audit_error``: the window's objective audit, if it had one.
        """
        divergence = None
        if self.fingerprints:
            row = _trace_row(step, stats, norms, audit_error)
            if self._writer is not None:
                self._writer.write(row)
            divergence = self._compare(step, row)
        metrics = window_metrics(stats, elapsed, naive_loss)
        if audit_error is not None:
            metrics["audit_error"] = audit_error
        log_now = False
        if self._reference is not None and self.settings.on_divergence == "log":
            metrics["reference_divergence"] = float(divergence is not None)
            log_now = divergence is not None
        if divergence is not None and self.first_divergence is None:
            self._diverged(divergence)
        return {f"{self.settings.prefix}{name}": value for name, value in metrics.items()}, log_now

    def _compare(self, step: int, row: dict[str, TraceValue]) -> Divergence | None:
        if self._reference is None:
            return None
        missing = self._reference.missing(step)
        if missing is None:
            return self._reference.compare(step, row)
        if self.settings.on_divergence == "raise":
            raise DivergenceError(missing)
        if not self._warned_past_reference:
            self._warned_past_reference = True
            rank_zero_warn(f"{missing} Such steps are not compared.")
        return None

    def _diverged(self, divergence: Divergence) -> None:
        self.first_divergence = divergence
        if self.settings.on_divergence == "raise":
            raise DivergenceError(divergence.message)
        if self.settings.on_divergence == "warn":
            rank_zero_warn(divergence.message)
        else:
            rank_zero_info(divergence.message)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _trace_row(
    step: int, stats: WindowStats, norms: tuple[Tensor | None, Tensor | None], audit_error: float | None
) -> dict[str, TraceValue]:
    present = [norm for norm in norms if norm is not None]
    host = iter(torch.stack(present).tolist() if present else [])  # one device-to-host copy for both fingerprints
    grad_norm, param_norm = (None if norm is None else next(host) for norm in norms)
    return {
        "step": step,
        "global_count": stats.global_count,
        "loss": stats.loss,
        "grad_norm": grad_norm,
        "param_norm": param_norm,
        "world_size": stats.world_size,
        "window_length": stats.window_length,
        "imbalance": stats.imbalance,
        "naive_weight_error": stats.naive_weight_error,
        "audit_error": audit_error,
    }


def window_metrics(stats: WindowStats, elapsed: float, naive_loss: float | None) -> dict[str, float]:
    """The metrics a monitor logs for one window (unprefixed)."""
    counts = stats.rank_counts or (stats.global_count,)
    metrics = {
        "global_count": stats.global_count,
        "rank_count_min": min(counts),
        "rank_count_max": max(counts),
        "rank_count_mean": stats.global_count / len(counts),
        "window_length": float(stats.window_length),
        "imbalance": stats.imbalance or 0.0,
        "naive_weight_error": stats.naive_weight_error or 0.0,
    }
    if stats.loss is not None:
        metrics["loss"] = stats.loss
    if stats.aux_loss is not None:  # an 'aux_loss' was returned: its mean over real micro-batches
        metrics["aux_loss"] = stats.aux_loss
    if elapsed > 0 and math.isfinite(elapsed):
        metrics["items_per_sec"] = stats.global_count / elapsed
    if naive_loss is not None:
        metrics["naive_loss"] = naive_loss
    return metrics


__all__ = ["MonitorSettings", "Observer", "OnDivergence", "window_metrics"]
