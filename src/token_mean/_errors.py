"""The one error every rank raises together when a window's denominator cannot be trusted."""

from __future__ import annotations


class DenominatorError(RuntimeError):
    """A count or loss made the global token mean of an optimizer step undefined or wrong.

    Raised on every rank at once, with the same message (the offending rank, the step and the fix), because the
    problem travels in the same collective as the counts: no rank is left waiting in a collective.
    """
