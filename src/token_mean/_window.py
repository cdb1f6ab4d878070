"""What one accumulation window (one optimizer step) used as its denominator."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowStats:
    """The denominator and loss of one optimizer step, identical on every rank.

    :class:`~token_mean.TokenMeanDDPStrategy` publishes one of these as ``strategy.last_window`` after the last
    micro-batch of each accumulation window (before ``on_before_optimizer_step``), so callbacks can log exactly what
    the update used. Counts are floats because an item can be a sample weight; integer counts are exact in float64
    up to 2**53.

    Attributes:
        global_count: N, the valid items of the window summed over all ranks and micro-batches.
        local_count: n_r, this rank's valid items in the window.
        rank_counts: n_r for every rank, indexed by global rank.
        window_length: micro-batches in the window (shorter than K for a partial last window).
        loss: the exact global mean loss of the window, Σ loss sums / N; ``None`` when N = 0.
        skipped: True when N = 0 on every rank: the optimizer step was skipped and no state changed.
        mode: ``"lookahead"`` or ``"deferred"`` (the strategy), or ``"measured"`` (``DenominatorMonitor`` without it).

    Example:
        >>> stats = WindowStats(8.0, 2.0, (2.0, 6.0), 1, 0.625, False, "lookahead")
        >>> stats.naive_weight_error
        0.5
    """

    global_count: float
    local_count: float
    rank_counts: tuple[float, ...]
    window_length: int
    loss: float | None
    skipped: bool
    mode: str

    @property
    def world_size(self) -> int:
        """P, the number of ranks that took part."""
        return len(self.rank_counts)

    @property
    def imbalance(self) -> float:
        """max n_r / mean n_r (1.0 is perfectly even; 0.0 when N = 0)."""
        if self.global_count == 0:
            return 0.0
        return max(self.rank_counts) * self.world_size / self.global_count

    @property
    def naive_weight_error(self) -> float:
        """max_r |P·n_r/N − 1|: how far a plain mean of rank means would have mis-weighted a rank's items."""
        if self.global_count == 0:
            return 0.0
        return max(abs(self.world_size * n / self.global_count - 1.0) for n in self.rank_counts)
