"""What the package reports about a run: each window's denominator and loss (:class:`WindowStats`), each audited
window (:class:`Audit`), and the first step that diverges from a reference trace (:class:`Divergence`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowStats:
    """The denominator and loss of one optimizer step.

    A token-mean strategy publishes one of these as ``strategy.last_window`` after the last micro-batch of each
    accumulation window (before ``on_before_optimizer_step``), so callbacks can log exactly what the update used;
    ``TokenMeanAccumulator.finish()`` returns it. Every field but ``local_count`` is identical on every rank. Counts are
    floats because an item can be a sample weight; integer counts are exact in float64 up to 2**53.

    Attributes:
        global_count: N, the valid items of the window summed over all ranks and micro-batches.
        local_count: n_r, this rank's valid items in the window (differs between ranks).
        rank_counts: n_r for every rank, indexed by rank; ``None`` unless asked for (they cost P floats per window in
            the collective: ``strategy.track_rank_counts()``, which ``DenominatorMonitor`` calls).
        window_length: micro-batches in the window (shorter than K for a partial last window), zero-weight fillers of
            exhausted ranks included.
        loss: the exact global mean loss of the window, Σ loss sums / N; ``None`` when N = 0.
        skipped: True when N = 0 on every rank: no update, no state changed.
        mode: how the count reached the gradient: ``"lookahead"`` or ``"deferred"``; ``"none"`` for a window that
            ``DenominatorMonitor`` measured under a strategy that does not normalize it.
        aux_loss: the mean of the ``"aux_loss"`` terms over the window's real micro-batches on all ranks, when
            ``training_step`` returns one; else ``None``.
        audit_error: the objective audit's ‖g − g*‖ / ‖g*‖ of the window (``FabricMonitor(audit_every=...)``);
            ``None`` when the window was not audited or had nothing to compare (N = 0).

    Example:
        >>> stats = WindowStats(8.0, 2.0, (2.0, 6.0), 1, 0.625, False, "lookahead")
        >>> stats.naive_weight_error
        0.5
    """

    global_count: float
    local_count: float
    rank_counts: tuple[float, ...] | None
    window_length: int
    loss: float | None
    skipped: bool
    mode: str
    aux_loss: float | None = None
    audit_error: float | None = None

    @property
    def world_size(self) -> int | None:
        """P, the number of ranks that took part (``None`` without ``rank_counts``)."""
        return None if self.rank_counts is None else len(self.rank_counts)

    @property
    def imbalance(self) -> float | None:
        """max n_r / mean n_r (1.0 is perfectly even; 0.0 when N = 0; ``None`` without ``rank_counts``)."""
        return self._per_rank(lambda counts, size: max(counts) * size / self.global_count)

    @property
    def naive_weight_error(self) -> float | None:
        """max_r |P·n_r/N − 1|: how far a plain mean of rank means would have mis-weighted a rank's items."""
        return self._per_rank(lambda counts, size: max(abs(size * n / self.global_count - 1.0) for n in counts))

    def _per_rank(self, figure: Callable[[tuple[float, ...], int], float]) -> float | None:
        if self.rank_counts is None:
            return None
        return 0.0 if self.global_count == 0 else figure(self.rank_counts, len(self.rank_counts))


@dataclass(frozen=True)
class Audit:
    """One audited window.

    Attributes:
        step: the optimizer step (as ``trainer.global_step`` before the update).
        error: ‖g − g*‖ / ‖g*‖, the largest over the ranks; ``None`` when the window had no valid item on any rank
            (N = 0: no objective, nothing to compare).
        tolerance: the largest error that passes.
        passed: ``error <= tolerance`` (True when there was nothing to compare).
    """

    step: int
    error: float | None
    tolerance: float
    passed: bool


@dataclass(frozen=True)
class Divergence:
    """The first quantity of one optimizer step that differs from the reference trace.

    Attributes:
        step: the optimizer step's 0-based index (the ``step`` its metrics are logged under).
        quantity: the trace column that differs: ``global_count``, ``loss``, ``grad_norm`` or ``param_norm``.
        value: the value in this run (``None`` where it was undefined).
        reference: the value in the reference trace.
        message: says which quantity diverged, both values and the likely cause.
    """

    step: int
    quantity: str
    value: float | None
    reference: float | None
    message: str


__all__ = ["Audit", "Divergence", "WindowStats"]
