"""`python -m token_mean.plot`: a PNG from two recorded traces, the first divergent step, and clear failures."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _harness import TokenModule
from _jobs import run_bounded
from _monitor_helpers import counts_data, trainer_for

import token_mean.plot
from token_mean._trace import TraceWriter, read_trace
from token_mean.callback import DenominatorMonitor
from token_mean.plot import DEFAULT_ATOL, DEFAULT_RTOL, compare_traces, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 12


def write_trace(path: Path, steps: range = range(STEPS), diverge_at: int | None = None, column: str = "grad_norm",
                factor: float = 1.01) -> Path:
    """A trace through the real writer; from `diverge_at` on, `column` is off by `factor`.

    As in a real run, a different gradient or update shows in the loss from the next step on (the loss of a step is
    taken before its update).
    """
    writer = TraceWriter(path)
    for step in steps:
        row: dict[str, float | int | None] = {
            "step": step,
            "global_count": 0.0 if step == 5 else 40.0 + step % 3,  # step 5: no valid item, so no loss
            "loss": None if step == 5 else 3.0 / (1 + step),
            "grad_norm": None if step == 5 else 1.0 + step / 10,
            "param_norm": 10.0 + step / 100,
            "world_size": 2,
            "imbalance": 1.0 + step % 3 / 10,
        }
        if diverge_at is not None and step >= diverge_at:
            value = row[column]
            row[column] = None if value is None else value * factor
            loss = row["loss"]
            if column in ("grad_norm", "param_norm") and step > diverge_at and loss is not None:
                row["loss"] = loss * (1 + 1e-3 * (step - diverge_at))
        writer.write(row)
    writer.close()
    return path


def test_writes_a_png_and_names_the_first_divergent_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reference = write_trace(tmp_path / "reference.csv")
    run = write_trace(tmp_path / "run.jsonl", diverge_at=7)
    output = tmp_path / "figures" / "compare.png"
    assert main([str(run), str(reference), "-o", str(output)]) == 0
    assert output.read_bytes().startswith(PNG_SIGNATURE) and output.stat().st_size > 10_000
    assert capsys.readouterr().out == f"{output}: first divergent step 7 (grad_norm).\n"


def test_default_output_and_identical_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without -o the figure goes beside RUN; identical losses (|Δ| = 0 everywhere) still draw."""
    reference = write_trace(tmp_path / "reference.csv")
    run = write_trace(tmp_path / "run.csv", steps=range(STEPS + 3))
    assert main([str(run), str(reference), "--rtol", "0", "--atol", "0"]) == 0
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_SIGNATURE)
    verdict = f"no divergent step in {STEPS} common steps (atol 0, rtol 0); 3 step(s) only in RUN"
    assert capsys.readouterr().out == f"{tmp_path / 'run.png'}: {verdict}.\n"


@pytest.mark.parametrize(("column", "factor", "rtol", "expected"), [
    ("global_count", 1 + 1e-8, 1.0, "global_count"),  # N is compared almost exactly whatever the tolerance
    ("loss", 1 + 2e-4, 1e-4, "loss"),
    ("loss", 1 + 2e-4, 1e-3, None),
    ("param_norm", 1 + 2e-4, 1e-4, "param_norm"),
])
def test_comparison_rules(tmp_path: Path, column: str, factor: float, rtol: float, expected: str | None) -> None:
    reference = read_trace(write_trace(tmp_path / "reference.csv"))
    run = read_trace(write_trace(tmp_path / "run.csv", diverge_at=3, column=column, factor=factor))
    comparison = compare_traces(run, reference, rtol=rtol, atol=0.0)
    assert (comparison.quantity, comparison.divergent_step) == (expected, None if expected is None else 3)


def test_agrees_with_the_monitor_on_recorded_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Traces recorded by real runs; the second sees other data from step 1 on, and the monitor flags it there."""
    reference = tmp_path / "reference.csv"
    trainer_for(tmp_path / "a", callbacks=[DenominatorMonitor(record=reference)]).fit(
        TokenModule(counts_data([[6, 4, 10, 7]]))
    )
    run = tmp_path / "run.csv"
    monitor = DenominatorMonitor(record=run, reference=reference, on_divergence="log")
    trainer_for(tmp_path / "b", callbacks=[monitor]).fit(TokenModule(counts_data([[6, 5, 10, 7]])))
    assert monitor.first_divergence is not None
    assert main([str(run), str(reference), "-o", str(tmp_path / "out.png")]) == 0
    expected = f"first divergent step {monitor.first_divergence.step} ({monitor.first_divergence.quantity})"
    assert expected == "first divergent step 1 (global_count)"
    assert expected in capsys.readouterr().out


def test_defaults_are_the_monitors() -> None:
    defaults = inspect.signature(DenominatorMonitor).parameters
    assert (defaults["rtol"].default, defaults["atol"].default) == (DEFAULT_RTOL, DEFAULT_ATOL)


@pytest.mark.parametrize(("arguments", "message"), [
    ([], r"the following arguments are required: RUN$"),
    (["{run}", "{reference}", "--rtol", "-1"], r"argument --rtol: must be a number >= 0, got '-1'"),
    (["{run}", "{reference}", "--atol", "nan"], r"argument --atol: must be a number >= 0, got 'nan'"),
    (["{run}", "{reference}", "-o", "out.jpg"], r"'out.jpg' must end in one of \['.png', '.pdf', '.svg'\]"),
    (["{run}", "{reference}", "--bins", "3"], r"unrecognized arguments: --bins 3"),
])
def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str],
                              message: str) -> None:
    paths = {"run": str(write_trace(tmp_path / "run.csv")), "reference": str(write_trace(tmp_path / "ref.csv"))}
    with pytest.raises(SystemExit) as exit_info:
        main([argument.format(**paths) for argument in arguments])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m token_mean.plot")
    assert re.search(message, err), err


@pytest.mark.parametrize(("case", "message"), [
    ("missing", r"The RUN trace '.*missing\.csv' does not exist\. Record one first with `DenominatorMonitor\(record="
                r"'.*missing\.csv'\)`\.$"),  # a command line reads it once: nothing about ranks
    ("directory", r"The REFERENCE trace '.*folder\.csv' is a directory"),
    ("suffix", r"`RUN='.*run\.txt'` has the suffix '\.txt'"),
    ("malformed", r"Malformed trace '.*bad\.csv', line 3: column 'loss' holds 'abc', not a number"),
    ("disjoint", r"The traces share no step: '.*late\.csv' holds steps 100\.\.101, '.*ref\.csv' holds 0\.\.11"),
])
def test_unreadable_traces_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str) -> None:
    reference = str(write_trace(tmp_path / "ref.csv"))
    (tmp_path / "folder.csv").mkdir()
    bad = tmp_path / "bad.csv"
    bad.write_text("step,global_count,loss,grad_norm,param_norm\n0,4,1,1,1\n1,4,abc,1,1\n")
    arguments = {
        "missing": [str(tmp_path / "missing.csv"), reference],
        "directory": [reference, str(tmp_path / "folder.csv")],
        "suffix": [str(tmp_path / "run.txt"), reference],
        "malformed": [str(bad), reference],
        "disjoint": [str(write_trace(tmp_path / "late.csv", steps=range(100, 102))), reference],
    }[case]
    assert main([*arguments, "-o", str(tmp_path / "out.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m token_mean.plot: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "out.png").exists()


def test_plots_a_single_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One trace: its loss, N and imbalance per step, named by its run folder (every trace is `trace.csv`)."""
    run = write_trace(tmp_path / "scaled" / "trace.csv")
    assert main([str(run)]) == 0
    output = run.with_suffix(".png")
    assert output.read_bytes().startswith(PNG_SIGNATURE) and output.stat().st_size > 10_000
    assert capsys.readouterr().out == f"{output}: {STEPS} steps of scaled.\n"
    rows = read_trace(run, "RUN", extra=("imbalance", "window_length"))
    assert [rows[step]["imbalance"] for step in (0, 1)] == [1.0, 1.1] and rows[0]["window_length"] is None
    older = tmp_path / "older.jsonl"  # a trace without the informational columns still reads (and draws)
    older.write_text('{"step": 0, "global_count": 4, "loss": 1.0, "grad_norm": 1.0, "param_norm": 1.0}\n')
    assert read_trace(older, "RUN", extra=("imbalance",)) == {
        0: {"global_count": 4.0, "loss": 1.0, "grad_norm": 1.0, "param_norm": 1.0, "imbalance": None}
    }
    assert main([str(older), "-o", str(tmp_path / "older.png")]) == 0


@pytest.mark.parametrize("traces", [1, 2], ids=["single-trace", "comparison"])
def test_every_y_label_stays_beside_its_own_panel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  traces: int) -> None:
    """A y-label taller than its panel runs into the panel above (the single trace's imbalance label did)."""


    extents: list[tuple[str, float, float, float, float]] = []

    def measure(plt: Any, figure: Any, output: Path) -> None:
        figure.tight_layout()
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        for axes in figure.axes:
            panel, label = axes.get_window_extent(renderer), axes.yaxis.label.get_window_extent(renderer)
            extents.append((axes.get_ylabel(), panel.y0, panel.y1, label.y0, label.y1))
        plt.close(figure)

    monkeypatch.setattr(token_mean.plot, "_save", measure)
    run = write_trace(tmp_path / "scaled" / "trace.csv")
    arguments = [str(run)] if traces == 1 else [str(run), str(write_trace(tmp_path / "reference" / "trace.csv"))]
    assert main([*arguments, "-o", str(tmp_path / "out.png")]) == 0
    assert len(extents) == 3
    for name, bottom, top, label_bottom, label_top in extents:
        assert bottom <= label_bottom and label_top <= top, (name, (bottom, top), (label_bottom, label_top))


def test_curves_are_labelled_by_run_folder() -> None:
    from token_mean.plot import _labels

    assert _labels([Path("runs/scaled/trace.csv"), Path("runs/reference/trace.csv")]) == ["scaled", "reference"]
    assert _labels([Path("out/run.jsonl"), Path("out/reference.csv")]) == ["run.jsonl", "reference.csv"]
    assert _labels([Path("a/x/trace.csv"), Path("b/x/trace.csv")]) == ["a/x/trace.csv", "b/x/trace.csv"]


def test_missing_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    reference = write_trace(tmp_path / "ref.csv")
    assert main([str(reference), str(reference), "-o", str(tmp_path / "out.png")]) == 1
    assert "Drawing traces needs matplotlib: `pip install matplotlib`" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_as_a_module(tmp_path: Path) -> None:
    """The command users type, in a fresh interpreter (imports torch and Lightning: seconds)."""
    reference = write_trace(tmp_path / "ref.csv")
    run = write_trace(tmp_path / "run.csv", diverge_at=4)
    command = [sys.executable, "-m", "token_mean.plot", str(run), str(reference), "-o", str(tmp_path / "f.png")]
    done = run_bounded(command, timeout=120, cwd=Path(token_mean.plot.__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path / 'f.png'}: first divergent step 4 (grad_norm).\n"
    assert (tmp_path / "f.png").read_bytes().startswith(PNG_SIGNATURE)
