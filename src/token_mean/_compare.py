"""Comparing a run with a reference trace, step by step: the first quantity that differs, and its likely cause."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from token_mean._trace import COMPARED_COLUMNS, TraceRow, read_trace
from token_mean.errors import DivergenceError
from token_mean.results import Divergence

COUNT_RTOL = 1e-9
"""N is compared almost exactly: a different count is never numerics, it is different data or a different count."""

_CAUSES = {
    "global_count": (
        "a different N at the same step means different data (order, sharding, batch size, drop_last) or a different"
        " count definition (`count_fn`: labels shifted inside the model → `count_shifted_labels`, class weights →"
        " `ClassWeightedCount`, another ignore_index)"
    ),
    "loss": (
        "the same N with a different loss means a count that does not match what the loss averages over (labels"
        " shifted inside the model: `count_shifted_labels`; class weights: `ClassWeightedCount`; another"
        " ignore_index), a different loss definition or numerics (precision, kernels), or parameters that already"
        " differed (compare the previous step's param fingerprint)"
    ),
    "grad_norm": (
        "the same N and loss with a different gradient means a different objective: a count that does not match"
        " what the loss averages over (labels shifted inside the model: `count_shifted_labels`; class weights:"
        " `ClassWeightedCount`; another ignore_index), plain DDP averaging per-rank means over uneven ranks, or"
        " Lightning dividing a short last window by the full `accumulate_grad_batches` (use"
        " `TokenMeanDDPStrategy`); otherwise different numerics"
    ),
    "param_norm": (
        "the same N, loss and gradient with different parameters after the update means a different optimizer,"
        " learning rate, scheduler or gradient clipping"
    ),
}


class TraceComparison:
    """A reference trace and the tolerances to compare each step of a run with it, in ``COMPARED_COLUMNS`` order.

    Reading is linear in the trace's length; only the compared columns are kept.
    """

    def __init__(self, path: str | os.PathLike[str], rtol: float, atol: float,
                 monitor: str = "DenominatorMonitor", rows: dict[int, TraceRow] | None = None) -> None:
        self.path = os.fspath(path)
        self.monitor = monitor  # the front end's monitor, named in messages
        # the trace at `path`, or `rows` already read (`python -m token_mean.plot` compares two it read)
        self.rows: dict[int, TraceRow] = read_trace(path, writer=monitor) if rows is None else rows
        self.rtol = rtol
        self.atol = atol

    def check_length(self, first_step: int, total_steps: float) -> None:
        """Raise if the reference covers other optimizer steps than a run of ``total_steps`` from ``first_step``."""
        if not math.isfinite(total_steps):
            return  # an unsized loader: steps missing from the trace are reported when they happen
        expected = range(first_step, int(total_steps))
        steps = list(self.rows)
        if not expected or (steps[-1] == expected[-1] and all(step in self.rows for step in expected)):
            return
        raise ValueError(
            f"The reference trace {self.path!r} covers {len(steps)} optimizer steps ({steps[0]}..{steps[-1]}) but"
            f" this run takes {len(expected)} (steps {expected.start}..{expected.stop - 1}): it comes from a"
            " different configuration. Record the reference with the same data, max_steps/max_epochs and global"
            " batch per optimizer step."
        )

    def missing(self, step: int) -> str | None:
        """Why ``step`` cannot be compared (it is not in the reference), or ``None``."""
        if step in self.rows:
            return None
        return (
            f"Step {step} is not in the reference trace {self.path!r} (steps {min(self.rows)}..{max(self.rows)}):"
            " the runs have different lengths. Record the reference with the same configuration."
        )

    def compare(self, step: int, row: Mapping[str, float | int | None]) -> Divergence | None:
        """The first quantity of ``step`` outside the tolerance, or ``None`` (also for a step not in the trace)."""
        reference = self.rows.get(step)
        if reference is None:
            return None
        for column in COMPARED_COLUMNS:
            value, expected = row[column], reference[column]
            value = None if value is None else float(value)
            rtol, atol = (COUNT_RTOL, 0.0) if column == "global_count" else (self.rtol, self.atol)
            if close(value, expected, rtol, atol):
                continue
            message = (
                f"{self.monitor}: step {step} diverged from the reference trace {self.path!r}: {column} is"
                f" {value!r} here but {expected!r} in the reference (tolerance {atol:g} + {rtol:g} × |reference|)."
                f" Likely cause: {_CAUSES[column]}."
            )
            return Divergence(step, column, value, expected, message)
        return None


def close(value: float | None, expected: float | None, rtol: float, atol: float) -> bool:
    if value is None or expected is None:
        return value is None and expected is None
    if math.isnan(value) or math.isnan(expected):
        return math.isnan(value) and math.isnan(expected)
    if math.isinf(value) or math.isinf(expected):
        return value == expected
    return abs(value - expected) <= atol + rtol * abs(expected)


__all__ = ["COUNT_RTOL", "Divergence", "DivergenceError", "TraceComparison", "close"]
