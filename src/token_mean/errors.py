"""The errors the package raises where a run would otherwise be silently wrong: each names what went wrong, where, and
the fix, and is raised on every rank at once."""

from __future__ import annotations


class DenominatorError(RuntimeError):
    """A count or loss made the global token mean of an optimizer step undefined or wrong.

    Raised on every rank at once, with the same message (the offending rank, the step and the fix), because the
    problem travels in the same collective as the counts: no rank is left waiting in a collective.
    """


class AuditError(DenominatorError):
    """The gradient the optimizer was about to apply is not the gradient of the window's objective (the audit)."""


class DivergenceError(RuntimeError):
    """Raised by ``DenominatorMonitor(on_divergence="raise")`` (or ``FabricMonitor``) at the first step that diverges
    from its reference."""


__all__ = ["AuditError", "DenominatorError", "DivergenceError"]
