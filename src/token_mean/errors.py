"""The errors raised where a run would otherwise be silently wrong, naming what, where and the fix."""

from __future__ import annotations


class DenominatorError(RuntimeError):
    """A count or loss made a step's global token mean undefined or wrong; raised on every rank with one message."""


class AuditError(DenominatorError):
    """The gradient the optimizer was about to apply is not the gradient of the window's objective (the audit)."""


class DivergenceError(RuntimeError):
    """Raised by a monitor with ``on_divergence="raise"`` at the first step that diverges from its reference."""


__all__ = ["AuditError", "DenominatorError", "DivergenceError"]
