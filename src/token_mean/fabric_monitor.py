"""``FabricMonitor``: what ``DenominatorMonitor`` is to the Trainer, for a Lightning Fabric loop.

It logs each window of a :class:`~token_mean.fabric.TokenMeanAccumulator`, writes or compares its trace, and audits
windows (``docs/audit.md``), of the accumulator's loop or of a plain one (LitGPT's ``fabric.backward(loss / K)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor

from token_mean._audit import AuditSchedule, FabricAuditing, OnAuditFailure
from token_mean._counting import CountFn
from token_mean._counts import count_valid_labels
from token_mean._fingerprint import global_norm, grad_norm
from token_mean._mode import LossReduction
from token_mean._observe import MonitorSettings, Observer, OnDivergence
from token_mean.results import Audit, Divergence, WindowStats


class FabricMonitor:
    """Log every window of a :class:`~token_mean.fabric.TokenMeanAccumulator` and write or compare its trace, as
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
    def first_divergence(self) -> Divergence | None:
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

    def micro_batch(self, model: Any, batch: Any, filler: bool = False) -> None:
        """A micro-batch's forward is about to run (the accumulator says so itself; a loop without it calls this)."""
        self.auditing.micro_batch(model, batch, filler)

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


__all__ = ["FabricMonitor"]
