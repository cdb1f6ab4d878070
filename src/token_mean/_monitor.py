"""What both monitors share: their settings, checked once, and what they do with each window (its metrics, a trace
row that rank zero writes and every rank compares, so all raise together, and the audit)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from token_mean._audit import Auditor, Objective, OnAuditFailure
from token_mean._fingerprint import global_norm
from token_mean._settings import (
    CountFn,
    LossReduction,
    Settings,
    checked_count_fn,
    checked_loss_reduction,
    positive_int,
)
from token_mean._trace import TraceComparison, TraceWriter, trace_format
from token_mean.errors import DivergenceError
from token_mean.results import Audit, Divergence, WindowStats

OnDivergence = Literal["warn", "raise", "log"]
TraceValue = float | int | None


class Monitoring:
    """The part of a monitor that knows neither Lightning's loop nor Fabric's.

    Args:
        count_fn, loss_reduction: what it measures and audits with where no token-mean front end says.
        logging_interval: log every this many steps; None: Lightning's ``log_every_n_steps`` (Fabric: every window).
        prefix: the metric names' prefix, ``"{prefix}/global_count"`` and so on.
        record: write this run's trace to this ``.csv`` or ``.jsonl`` file (overwritten when the run starts).
        reference: compare every step with this trace, within ``atol + rtol·|reference|`` (N within 1e-9).
        on_divergence: at the first divergent step, ``"warn"``, ``"raise"`` or ``"log"`` (then at every step).
        audit_every, on_audit_failure, audit_tolerance: audit the first window and every ``audit_every``-th after it
            (``docs/audit.md``).
        audit_loss: ``fn(model, batch) -> loss``, a micro-batch's loss as the loop computes it (the Trainer's
            monitor replays ``training_step`` without it).
    """

    def __init__(
        self,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction | None = None,
        logging_interval: int | None = None,
        prefix: str = "denominator",
        record: str | os.PathLike[str] | None = None,
        reference: str | os.PathLike[str] | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-6,
        on_divergence: OnDivergence = "warn",
        audit_every: int | None = None,
        on_audit_failure: OnAuditFailure = "warn",
        audit_tolerance: float | None = None,
        audit_loss: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        # each setting out of range: an error naming the argument, its value and the fix
        positive_int(logging_interval, "logging_interval", "optimizer steps", "the front end's own cadence")
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
        if audit_loss is not None and not callable(audit_loss):
            raise TypeError(f"`audit_loss` must be a callable fn(model, batch) -> loss, got {audit_loss!r}.")
        self.count_fn: CountFn | None = checked_count_fn(count_fn)
        self.loss_reduction: LossReduction | None = checked_loss_reduction(loss_reduction)
        self.prefix = f"{prefix}/" if prefix and not prefix.endswith("/") else prefix
        self.record, self.reference = record, reference
        self.rtol, self.atol = float(rtol), float(atol)
        self.on_divergence: OnDivergence = on_divergence
        self.audit_loss = audit_loss
        self._auditor = Auditor(audit_every, on_audit_failure, audit_tolerance, type(self).__name__)
        self.audits: list[Audit] = self._auditor.audits  # every audited window of the last run, in order
        self.logging_interval = logging_interval
        self.last_window: WindowStats | None = None
        """The window of the last optimizer step, as logged."""
        self.first_divergence: Divergence | None = None
        """The first divergent step of the last run (set on every rank), None if none or no reference."""
        self._reference: TraceComparison | None = None
        self._writer: TraceWriter | None = None
        self._terms: tuple[str, ...] = ()  # an objective of several terms: their names, from the front end
        self._warned_past_reference = False
        self._constructed()

    def _constructed(self) -> None:
        """What a front end's monitor checks and sets up once the shared settings are checked."""

    def _read_reference(self, terms: tuple[str, ...] = ()) -> None:
        self._terms = terms
        if self.reference is not None:
            self._reference = TraceComparison(self.reference, self.rtol, self.atol, type(self).__name__, terms=terms)

    @property
    def fingerprints(self) -> bool:
        """Whether a trace needs each step's norms, on every rank (a sharded model's norm is a collective)."""
        return self.record is not None or self.reference is not None

    def _start_run(self, writes: bool, first_step: int, total_steps: float) -> None:
        """A run starts at ``first_step`` and takes ``total_steps`` (``inf``: unknown); ``writes``: rank zero."""
        self.first_divergence, self.last_window = None, None
        self._warned_past_reference = False
        if self._reference is not None:
            self._reference.check_length(first_step, total_steps)
        if self.record is not None and writes:
            self._writer = TraceWriter(self.record, self._terms)

    def _window(
        self,
        step: int,
        stats: WindowStats,
        elapsed: float,
        gradient: Tensor | None,
        model: Any,
        device: Any,
        naive_loss: float | None = None,
    ) -> tuple[dict[str, float], bool]:
        """A window ended at ``step`` and its update is done: its prefixed metrics and whether to log them now;
        ``gradient``: the window's gradient norm on the device (the parameters' is taken here, after the update)."""
        self.last_window = stats
        divergence = None
        if self.fingerprints:
            row = _trace_row(step, stats, (gradient, global_norm([p.detach() for p in model.parameters()], device)))
            if self._writer is not None:
                self._writer.write(row)
            divergence = self._compare(step, row)
        metrics = window_metrics(stats, elapsed, naive_loss)
        log_now = stats.audit_error is not None
        if self._reference is not None and self.on_divergence == "log":
            metrics["reference_divergence"] = float(divergence is not None)
            log_now = log_now or divergence is not None
        if divergence is not None and self.first_divergence is None:
            self.first_divergence = divergence
            if self.on_divergence == "raise":
                raise DivergenceError(divergence.message)
            (rank_zero_warn if self.on_divergence == "warn" else rank_zero_info)(divergence.message)
        return {f"{self.prefix}{name}": value for name, value in metrics.items()}, log_now

    def _compare(self, step: int, row: dict[str, TraceValue]) -> Divergence | None:
        if self._reference is None:
            return None
        missing = self._reference.missing(step)
        if missing is None:
            return self._reference.compare(step, row)
        if self.on_divergence == "raise":
            raise DivergenceError(missing)
        if not self._warned_past_reference:
            self._warned_past_reference = True
            rank_zero_warn(f"{missing} Such steps are not compared.")
        return None

    def close(self) -> None:
        """Close the trace file (the writer also closes it when the monitor goes)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _trace_row(step: int, stats: WindowStats, norms: tuple[Tensor | None, Tensor | None]) -> dict[str, TraceValue]:
    present = [norm for norm in norms if norm is not None]
    host = iter(torch.stack(present).tolist() if present else [])  # one device-to-host copy for both fingerprints
    grad_norm, param_norm = (None if norm is None else next(host) for norm in norms)
    terms = {
        f"{name}/{column}": getattr(term, column)
        for name, term in (stats.terms or {}).items()
        for column in ("global_count", "loss")
    }
    return {
        **terms,
        "step": step,
        "global_count": stats.global_count,
        "loss": stats.loss,
        "grad_norm": grad_norm,
        "param_norm": param_norm,
        "world_size": stats.world_size,
        "window_length": stats.window_length,
        "imbalance": stats.imbalance,
        "naive_weight_error": stats.naive_weight_error,
        "audit_error": stats.audit_error,
    }


def window_metrics(stats: WindowStats, elapsed: float, naive_loss: float | None) -> dict[str, float]:
    """The metrics a monitor logs for one window (unprefixed). With several terms, whose counts count unlike items
    (tokens and examples), the counts and the per-rank figures are each term's, ``{name}/...``: none adds them up."""
    metrics = {"window_length": float(stats.window_length)}
    if stats.loss is not None:
        metrics["loss"] = stats.loss
    if stats.aux_loss is not None:  # an 'aux_loss' was returned: its mean over real micro-batches
        metrics["aux_loss"] = stats.aux_loss
    if naive_loss is not None:
        metrics["naive_loss"] = naive_loss
    if stats.audit_error is not None:
        metrics["audit_error"] = stats.audit_error
    if not stats.terms:
        return {**metrics, **_count_metrics(stats, elapsed, "")}
    for name, term in stats.terms.items():
        metrics.update(_count_metrics(term, elapsed, f"{name}/"))
        if term.loss is not None:
            metrics[f"{name}/loss"] = term.loss
    return metrics


def _count_metrics(stats: WindowStats, elapsed: float, prefix: str) -> dict[str, float]:
    counts = stats.rank_counts or (stats.global_count,)
    metrics = {
        "global_count": stats.global_count,
        "rank_count_min": min(counts),
        "rank_count_max": max(counts),
        "rank_count_mean": stats.global_count / len(counts),
        "imbalance": stats.imbalance or 0.0,
        "naive_weight_error": stats.naive_weight_error or 0.0,
    }
    if elapsed > 0 and math.isfinite(elapsed):
        metrics["items_per_sec"] = stats.global_count / elapsed
    return {f"{prefix}{key}": value for key, value in metrics.items()}


def objective(
    loss: Callable[[Any, Any], Any], count_fn: Any, reduction: LossReduction, context: Any, settings: Settings | None
) -> Objective:
    """What the audit replays; ``settings``: those of a token-mean front end (None: a plain strategy or loop)."""
    if settings is None:
        return Objective(loss, count_fn, reduction, False, context)
    lookahead, deferred = settings.mode == "lookahead", settings.mode == "deferred"  # aux loss; `num_items` counts
    return Objective(loss, count_fn, reduction, lookahead, context, settings.terms, deferred, settings.check_count)


def replayed(audit_loss: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``audit_loss(module, batch)`` as the audit replays a recorded micro-batch: the step's output."""
    return lambda module, micro_batch: audit_loss(module, micro_batch.batch)


def audited(stats: WindowStats, audit: Audit | None) -> WindowStats:
    return stats if audit is None else replace(stats, audit_error=audit.error)
