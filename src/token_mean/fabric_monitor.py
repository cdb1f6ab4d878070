"""``FabricMonitor``: what ``DenominatorMonitor`` is to the Trainer, for a Lightning Fabric loop."""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from token_mean import _lightning
from token_mean._counts import count_valid_labels
from token_mean._fingerprint import grad_norm
from token_mean._layout import World, shared_world
from token_mean._monitor import Monitoring, audited, objective, replayed
from token_mean._settings import Settings
from token_mean.results import Audit, WindowStats

_PLAIN_LOOP_UNSEEN = (
    "the loop's own scaling of the loss (`fabric.backward(loss / K)` averages micro-batch means, a mean of means:"
    " use `TokenMeanAccumulator`); an `audit_loss` that is not the loop's loss; gradient hooks on parameters or"
    " modules; DDP's reducer and comm hooks, FSDP2's reduce-scatter and its gradient divide factor; parameters DDP"
    " does not reduce (unfrozen after `fabric.setup`); anything the loop does to `.grad` before the audit"
)
_ACCUMULATED_UNSEEN = (
    "gradient hooks on parameters or modules; an `audit_loss` that is not the loss passed to `accumulator.backward`;"
    " parameters DDP does not reduce; anything the loop does to `.grad` between the backward and `finish()`"
)


class FabricMonitor(Monitoring):
    """What :class:`~token_mean.DenominatorMonitor` is to the Trainer, for a Fabric loop (``docs/fabric.md``): the same
    arguments (``_monitor.Monitoring``), metrics (via ``fabric.log_dict``), trace and comparison. With ``audit_every``,
    ``accumulator.finish()`` audits; a loop without the accumulator calls :meth:`micro_batch` before each forward and
    :meth:`audit` after a window's last backward (give the monitor ``count_fn``).

    Raises:
        ValueError, TypeError: for a setting out of range, or ``audit_every`` without ``audit_loss``.

    Example:
        >>> monitor = FabricMonitor(record="runs/trace.csv")  # then TokenMeanAccumulator(..., monitor=monitor)
        >>> monitor.fingerprints
        True
    """

    def _constructed(self) -> None:
        if self._auditor.enabled and self.audit_loss is None:
            raise ValueError(
                f"`audit_every={self._auditor.every}` needs `audit_loss`, a callable fn(model, batch) -> loss computing"
                " the micro-batch's loss exactly as the loop does, got None."
            )
        self._read_reference()
        self._fabric: Any = None
        self._module: nn.Module | None = None  # the unwrapped module, once attached
        self._step = 0  # windows logged
        self._windows = 0  # windows audited or not (the audit's numbering)
        self._open = False  # a window's first micro-batch was recorded
        self._pending: tuple[WindowStats, float, Any] | None = None  # finished, its step not yet taken
        self._started_at = time.perf_counter()
        self._started = False

    def attach(self, model: Any, settings: Settings | None = None, world: World | None = None) -> None:
        """The model ``fabric.setup`` returned (else a ``ValueError``), with the accumulator's settings and ranks."""
        if settings is not None and settings.terms:  # the reference's and the trace's term columns
            self._read_reference(tuple(term.name for term in settings.terms))
        if not self._auditor.enabled:
            return
        modules, strategy = _lightning.fabric_modules(model), _lightning.fabric_strategy_of(model)
        if modules is None or strategy is None:
            raise ValueError(f"The audit needs the model `fabric.setup` returned, got {type(model).__name__}.")
        if world is None:  # a loop without the accumulator: the ranks its layout would have
            world = shared_world(strategy, modules[0])
        count_fn = settings.count_fn if settings is not None else self.count_fn or count_valid_labels
        reduction = settings.loss_reduction if settings is not None else self.loss_reduction or "mean"
        self._module = modules[1]
        loss = replayed(self.audit_loss)  # type: ignore[arg-type]  # required with `audit_every`
        audited_objective = objective(loss, count_fn, reduction, strategy.precision.forward_context, settings)
        self._auditor.prepare(self._module, audited_objective, world, None, getattr(strategy, "device_mesh", None))
        self._auditor.start(0)

    def resume_at(self, step: int) -> None:
        """A resumed run (``accumulator.load_state_dict``): its windows are numbered on from the checkpoint's."""
        self._step = step

    def start(self, fabric: Any) -> None:
        """A pass starts (the first one opens the trace)."""
        self._fabric = fabric
        if not self._started:
            self._start_run(fabric.global_rank == 0, self._step, float("inf"))
            self._started = True
        self._started_at = time.perf_counter()

    def micro_batch(self, model: Any, batch: Any, filler: bool = False) -> None:
        """A micro-batch's forward is about to run (the accumulator says so itself; a loop without it calls this)."""
        if self._auditor.enabled and self._module is None:
            self.attach(model)
        self._auditor.micro_batch(self._windows, not self._open, batch, filler)
        self._open = True

    def audit(self, model: Any, unseen: str = _PLAIN_LOOP_UNSEEN) -> Audit | None:
        """In a loop without the accumulator: the window's last backward is done; its audit (None if not audited)."""
        window, self._windows, self._open = self._windows, self._windows + 1, False
        if self._module is None:
            return None
        self._auditor.audit(self._module, window, lambda: unseen)
        return self._auditor.window_end(window)

    def finished(self, model: Any, stats: WindowStats) -> WindowStats:
        """A window ended (``accumulator.finish()``): its audit and gradient norm now, before clipping."""
        stats = audited(stats, self.audit(model, _ACCUMULATED_UNSEEN))
        gradient = grad_norm(model, self._fabric.device) if self.fingerprints else None
        self._pending = (stats, time.perf_counter() - self._started_at, gradient)
        return stats

    def stepped(self, model: Any) -> None:
        """The loop came back for a batch after a finished window: its update is done."""
        if self._pending is None:
            return
        (stats, elapsed, gradient), self._pending = self._pending, None
        metrics, log_now = self._window(self._step, stats, elapsed, gradient, model, self._fabric.device)
        interval = self.logging_interval or 1
        if ((self._step + 1) % interval == 0 or log_now) and self._fabric.global_rank == 0:
            self._fabric.log_dict(metrics, step=self._step)
        self._step += 1
        self._started_at = time.perf_counter()


__all__ = ["FabricMonitor"]
