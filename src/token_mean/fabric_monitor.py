"""``FabricMonitor``: what ``DenominatorMonitor`` is to the Trainer, for a Lightning Fabric loop.

It logs each window of a :class:`~token_mean.fabric.TokenMeanAccumulator`, writes or compares its trace, and audits
windows (``docs/audit.md``), of the accumulator's loop or of a plain one (LitGPT's ``fabric.backward(loss / K)``).
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from token_mean import _lightning
from token_mean._audit import Objective
from token_mean._fingerprint import global_norm, grad_norm
from token_mean._layout import World, shared_world
from token_mean._monitor import Monitoring, audited, replayed
from token_mean._settings import Settings
from token_mean._counts import count_valid_labels
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
    """Log every window of a :class:`~token_mean.fabric.TokenMeanAccumulator` and write or compare its trace, as
    :class:`~token_mean.DenominatorMonitor` does under the Trainer: the same arguments and defaults, metrics, trace
    columns and comparison.

    Metrics go through ``fabric.log_dict`` from rank zero under the window's step (windows finished before it), every
    window or every ``logging_interval`` windows; ``grad_norm`` is taken in ``finish()`` (before clipping),
    ``param_norm`` after the optimizer step (when the loop asks for the next batch). The reference is read here.

    With ``audit_every``, ``finish()`` audits the first window and every N-th after it and puts the figure on its
    ``WindowStats.audit_error``; ``audit_loss(model, batch)`` is then required. A loop without the accumulator is
    audited by calling :meth:`micro_batch` before each micro-batch's forward and :meth:`audit` after the window's last
    backward, before clipping and the step; ``count_fn`` and ``loss_reduction`` are then the audit's (with the
    accumulator, its own).

    Args: as :class:`~token_mean.DenominatorMonitor`'s (``_monitor.Monitoring``).
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
        self._objective: Objective | None = None
        self._step = 0  # windows logged
        self._windows = 0  # windows audited or not (the audit's numbering)
        self._open = False  # a window's first micro-batch was recorded
        self._pending: tuple[WindowStats, float, Any] | None = None  # finished, its step not yet taken
        self._started_at = time.perf_counter()
        self._started = False

    def attach(self, model: Any, settings: Settings | None = None, world: World | None = None) -> None:
        """The model ``fabric.setup`` returned (with the accumulator's settings and the ranks that share its N);
        a ``ValueError`` if it cannot be audited."""
        if not self._auditor.enabled:
            return
        modules, strategy = _lightning.fabric_modules(model), _lightning.fabric_strategy_of(model)
        if modules is None or strategy is None:
            raise ValueError(f"The audit needs the model `fabric.setup` returned, got {type(model).__name__}.")
        if world is None:  # a loop without the accumulator: the ranks its layout would have
            world = shared_world(strategy, modules[0])
        count_fn = settings.count_fn if settings is not None else self.count_fn or count_valid_labels
        reduction = settings.loss_reduction if settings is not None else self.loss_reduction or "mean"
        aux = settings is not None and settings.mode == "lookahead"
        self._module = modules[1]
        loss = replayed(self.audit_loss)  # type: ignore[arg-type]  # required with `audit_every`
        objective = Objective(loss, count_fn, reduction, aux, strategy.precision.forward_context)
        self._auditor.prepare(self._module, objective, world, None, getattr(strategy, "device_mesh", None))
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
        param_norm = global_norm([p.detach() for p in model.parameters()], self._fabric.device) \
            if self.fingerprints else None
        metrics, log_now = self._window(self._step, stats, elapsed, (gradient, param_norm))
        interval = self.logging_interval or 1
        if ((self._step + 1) % interval == 0 or log_now) and self._fabric.global_rank == 0:
            self._fabric.log_dict(metrics, step=self._step)
        self._step += 1
        self._started_at = time.perf_counter()


__all__ = ["FabricMonitor"]
