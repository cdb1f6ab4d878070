"""Draw a run's ``DenominatorMonitor`` trace, alone or against a reference's (docs/monitor.md)::

    python -m token_mean.plot runs/scaled/trace.csv                      # loss, N and imbalance per step
    python -m token_mean.plot runs/scaled/trace.csv runs/reference/trace.csv -o compare.png --rtol 1e-5

Against a reference: both losses, |Δ loss| with the monitor's tolerance, and both runs' N, with the first divergent
step (judged as ``DenominatorMonitor(reference=...)`` judges it) marked and printed. The figure defaults to RUN as a
``.png``. Exit status: 0 when the figure is written, 1 when a trace, matplotlib or the figure fails, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from token_mean._trace import TraceComparison, TraceRow, read_trace

DEFAULT_RTOL = 1e-4
"""``DenominatorMonitor``'s default ``rtol`` (a test keeps them equal)."""
DEFAULT_ATOL = 1e-6
FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
"""Formats matplotlib's Agg backend writes without extra packages."""


@dataclass(frozen=True)
class Comparison:
    """Where two traces agree and where they first part: the common ``steps`` in order, the first step outside the
    tolerance and its first differing column (``None`` if none), and how many steps only one trace holds."""

    steps: list[int]
    divergent_step: int | None
    quantity: str | None
    only_in_run: int
    only_in_reference: int


def compare_traces(run: dict[int, TraceRow], reference: dict[int, TraceRow], rtol: float, atol: float) -> Comparison:
    """Compare two traces (step → row, as :func:`read_trace` gives them) step by step, as the monitor does.

    Example:
        >>> reference = {0: {"global_count": 8.0, "loss": 2.0, "grad_norm": 1.0, "param_norm": 5.0},
        ...              1: {"global_count": 8.0, "loss": 1.5, "grad_norm": 0.8, "param_norm": 5.1}}
        >>> run = {0: dict(reference[0]), 1: dict(reference[1], grad_norm=0.9), 2: dict(reference[1])}
        >>> comparison = compare_traces(run, reference, rtol=1e-4, atol=1e-6)
        >>> comparison.divergent_step, comparison.quantity, comparison.only_in_run
        (1, 'grad_norm', 1)
    """
    steps = [step for step in run if step in reference]
    comparison = TraceComparison("the reference", rtol, atol, rows=reference)  # the monitor's own comparison
    first = next((found for step in steps if (found := comparison.compare(step, run[step])) is not None), None)
    divergent_step, quantity = (None, None) if first is None else (first.step, first.quantity)
    return Comparison(steps, divergent_step, quantity, len(run) - len(steps), len(reference) - len(steps))


def _labels(paths: Sequence[Path]) -> list[str]:
    """What the figure calls each trace: its run folder, else its file name, else its path as given."""
    for names in ([path.resolve().parent.name for path in paths], [path.name for path in paths]):
        if all(names) and len(set(names)) == len(names):
            return names
    return [str(path) for path in paths]


def _values(trace: dict[int, TraceRow], column: str, steps: Sequence[int]) -> list[float]:
    # NaN where a value is missing (the loss of a step with N = 0): matplotlib leaves a gap there.
    return [math.nan if (value := trace[step][column]) is None else value for step in steps]


def _figure(output: str | os.PathLike[str]) -> Path:
    output = Path(output)
    if output.suffix.lower() not in FIGURE_SUFFIXES:
        raise ValueError(f"The figure {str(output)!r} must end in one of {list(FIGURE_SUFFIXES)}.")
    return output


def plot_traces(
    run_path: str | os.PathLike[str],
    reference_path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
) -> Comparison:
    """Read both traces, draw them into ``output`` and return their :class:`Comparison`.

    Raises what :func:`~token_mean._trace.read_trace` raises; ``ValueError`` if the traces share no step or
    ``output`` is not one of ``FIGURE_SUFFIXES``; ``ModuleNotFoundError`` without matplotlib.
    """
    output = _figure(output)
    run = read_trace(run_path, "RUN")
    reference = read_trace(reference_path, "REFERENCE")
    comparison = compare_traces(run, reference, rtol, atol)
    if not comparison.steps:
        raise ValueError(
            f"The traces share no step: {str(run_path)!r} holds steps {min(run)}..{max(run)}, {str(reference_path)!r}"
            f" holds {min(reference)}..{max(reference)}. Are they from the same configuration?"
        )
    _draw(run, reference, comparison, (Path(run_path), Path(reference_path)), output, (rtol, atol))
    return comparison


_RUN_STYLE = {"color": "tab:blue", "linewidth": 1.3}
_REFERENCE_STYLE = {"color": "black", "linewidth": 3.5, "alpha": 0.3}


def _draw(
    run: dict[int, TraceRow],
    reference: dict[int, TraceRow],
    comparison: Comparison,
    paths: tuple[Path, Path],
    output: Path,
    tolerances: tuple[float, float],
) -> None:
    """The three panels: both losses; |Δ loss| against the tolerance; both runs' N."""
    plt = _pyplot()
    names = _labels(paths)
    curves = ((reference, f"reference: {names[1]}", _REFERENCE_STYLE), (run, f"run: {names[0]}", _RUN_STYLE))
    figure, (loss_axes, delta_axes, count_axes) = plt.subplots(
        3, 1, sharex=True, figsize=(10, 9), height_ratios=(3, 2, 1.5)
    )
    for axes, column, drawstyle in ((loss_axes, "loss", "default"), (count_axes, "global_count", "steps-mid")):
        for trace, label, style in curves:
            steps = sorted(trace)
            axes.plot(steps, _values(trace, column, steps), label=label, drawstyle=drawstyle, **style)
    loss_axes.set_ylabel("loss: token mean of the step")
    loss_axes.set_title(f"{paths[0]} against {paths[1]}", fontsize="medium")
    loss_axes.legend(loc="upper right")
    count_axes.set_ylabel("N per step")
    count_axes.set_xlabel("optimizer step")
    rtol, atol = tolerances
    run_loss, reference_loss = _values(run, "loss", comparison.steps), _values(reference, "loss", comparison.steps)
    # A step that matches exactly (0) has no place on a log scale: left out rather than drawn at a made-up floor.
    deltas = [abs(a - b) or math.nan for a, b in zip(run_loss, reference_loss, strict=True)]
    tolerance = [atol + rtol * abs(loss) for loss in reference_loss]
    delta_axes.plot(comparison.steps, deltas, label="|run loss − reference loss|", **_RUN_STYLE)
    delta_axes.plot(
        comparison.steps, tolerance, color="grey", linestyle=":", label=f"tolerance {atol:g} + {rtol:g}·|reference|"
    )
    if any(value > 0 for value in (*deltas, *tolerance)):  # NaN compares False: skipped
        delta_axes.set_yscale("log")
    delta_axes.set_ylabel("|Δ loss|")
    delta_axes.legend(loc="best", fontsize="small")
    if comparison.divergent_step is not None:
        for axes in (loss_axes, delta_axes, count_axes):
            axes.axvline(comparison.divergent_step, color="tab:red", linestyle=":", linewidth=1)
        delta_axes.annotate(
            f" first divergent step: {comparison.divergent_step} ({comparison.quantity})",
            (comparison.divergent_step, 0.85),
            xycoords=("data", "axes fraction"),
            color="tab:red",
            fontsize="small",
        )
    _save(plt, figure, output)


def plot_run(run_path: str | os.PathLike[str], output: str | os.PathLike[str]) -> int:
    """Draw one trace's loss, N and imbalance per step into ``output``; return its number of steps (raises as
    :func:`plot_traces`)."""
    output = _figure(output)
    run = read_trace(run_path, "RUN", extra=("imbalance",))
    plt = _pyplot()
    steps = sorted(run)
    figure, panels = plt.subplots(3, 1, sharex=True, figsize=(10, 7), height_ratios=(3, 1.5, 1.5))
    # labels on two lines: one line is taller than the short panels and ran into the panel above
    rows = (
        ("loss", "loss\ntoken mean of the step"),
        ("global_count", "N\nper step"),
        ("imbalance", "imbalance\nmax n_r / mean n_r"),
    )
    for axes, (column, label) in zip(panels, rows, strict=True):
        drawstyle = "default" if column == "loss" else "steps-mid"
        axes.plot(steps, _values(run, column, steps), drawstyle=drawstyle, **_RUN_STYLE)
        axes.set_ylabel(label)
    panels[0].set_title(f"{_labels([Path(run_path)])[0]} ({run_path})", fontsize="medium")
    panels[-1].set_xlabel("optimizer step")
    _save(plt, figure, output)
    return len(steps)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:  # an optional dependency: the monitor itself never draws
        raise ModuleNotFoundError(
            "Drawing traces needs matplotlib: `pip install matplotlib` (or, in a clone, `pip install -e '.[plot]'`)."
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, figure: Any, output: Path) -> None:
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    def tolerance(text: str) -> float:
        value = float(text)
        if not value >= 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
        return value

    parser = argparse.ArgumentParser(
        prog="python -m token_mean.plot",
        description="Draw a DenominatorMonitor trace: alone, its loss, N and imbalance per step; against a"
        " reference trace, both losses, |Δ loss| with the monitor's tolerance, the first divergent step, and N.",
    )
    parser.add_argument("run", metavar="RUN", help="the trace to draw (.csv or .jsonl)")
    parser.add_argument("reference", metavar="REFERENCE", nargs="?", help="a trusted trace to compare it with")
    parser.add_argument("-o", "--output", help=f"the figure, {'/'.join(FIGURE_SUFFIXES)} (default: RUN as .png)")
    parser.add_argument("--rtol", type=tolerance, default=DEFAULT_RTOL, help="relative tolerance (the monitor's)")
    parser.add_argument("--atol", type=tolerance, default=DEFAULT_ATOL, help="absolute tolerance (the monitor's)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (argparse exits with 2 itself for bad arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    output = Path(args.output) if args.output is not None else Path(args.run).with_suffix(".png")
    if output.suffix.lower() not in FIGURE_SUFFIXES:
        parser.error(f"-o/--output: {str(output)!r} must end in one of {list(FIGURE_SUFFIXES)}")
    try:
        if args.reference is None:
            print(f"{output}: {plot_run(args.run, output)} steps of {_labels([Path(args.run)])[0]}.")
            return 0
        comparison = plot_traces(args.run, args.reference, output, rtol=args.rtol, atol=args.atol)
    except (OSError, ValueError, ImportError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    if comparison.divergent_step is None:
        verdict = f"no divergent step in {len(comparison.steps)} common steps (atol {args.atol:g}, rtol {args.rtol:g})"
    else:
        verdict = f"first divergent step {comparison.divergent_step} ({comparison.quantity})"
    unmatched = [
        f"{count} step(s) only in {name}"
        for count, name in ((comparison.only_in_run, "RUN"), (comparison.only_in_reference, "REFERENCE"))
        if count
    ]
    print(f"{output}: {verdict}{'; ' + ', '.join(unmatched) if unmatched else ''}.")
    return 0


__all__ = ["Comparison", "compare_traces", "main", "plot_run", "plot_traces"]


if __name__ == "__main__":
    sys.exit(main())
