"""What the package reports about a run: windows (:class:`WindowStats`), audits and divergences."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowStats:
    """The denominator and loss of one optimizer step, as ``strategy.last_window`` (before the optimizer step) or
    ``TokenMeanAccumulator.finish()`` gives it. All fields but ``local_count`` agree on every rank.

    Attributes:
        global_count: N, the window's valid items over all ranks and micro-batches (float: items may be weights).
        local_count: n_r, this rank's valid items in the window.
        rank_counts: n_r per rank; ``None`` unless ``strategy.track_rank_counts()`` (P floats per window).
        window_length: micro-batches in the window, zero-weight fillers included.
        loss: the exact global mean loss, Σ loss sums / N; ``None`` when N = 0.
        skipped: True when N = 0 on every rank: no update.
        mode: ``"lookahead"``, ``"deferred"``, or ``"none"`` (measured under a strategy that does not normalize).
        aux_loss: the mean ``"aux_loss"`` over the window's real micro-batches, else ``None``.
        audit_error: the audit's ‖g − g*‖ / ‖g*‖; ``None`` when not audited or N = 0.
        terms: an objective of several terms: each term's own stats by name, a ``WindowStats`` whose
            ``global_count`` is N_t, ``local_count`` n_t and ``loss`` the term's global mean (``None`` when N_t = 0);
            then ``global_count`` and ``local_count`` here add the terms' counts and ``loss`` is J. Else ``None``.

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
    terms: Mapping[str, WindowStats] | None = None

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
    """One audited window: its ``step`` (``trainer.global_step`` before the update), the ``error`` ‖g − g*‖ / ‖g*‖
    (largest over ranks; ``None`` when N = 0), the ``tolerance``, whether it ``passed`` (True if N = 0), and the
    count check's ``count_error``, its largest relative mismatch over ranks (``None``: nothing checkable; it fails
    the audit above its own tolerance, ``docs/counts.md``)."""

    step: int
    error: float | None
    tolerance: float
    passed: bool
    count_error: float | None = None


@dataclass(frozen=True)
class Divergence:
    """The first ``quantity`` (trace column) of optimizer ``step`` that differs from the reference: its ``value``
    here (``None`` if undefined), the ``reference`` value, and a ``message`` with both and the likely cause."""

    step: int
    quantity: str
    value: float | None
    reference: float | None
    message: str


__all__ = ["Audit", "Divergence", "WindowStats"]
