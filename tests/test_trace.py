"""The trace reader: what the writer wrote comes back exactly, at 100k steps; anything else names its file and line."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from token_mean._trace import COMPARED_COLUMNS, TraceWriter, read_trace

HEADER = "step,global_count,loss,grad_norm,param_norm"
ROW = "0,4,1.5,0.5,2.0"
LONG_TRACE_STEPS = 100_000


def row_of(step: int) -> dict[str, float | int | None]:
    """Distinct, exactly representable-or-not values per step, and the holes a real trace has (N = 0: no loss)."""
    empty = step % 97 == 0
    return {
        "step": 3 * step,  # gaps, as a trace resumed from a checkpoint may have
        "global_count": 0.0 if empty else float(step % 1000 + 1),
        "loss": None if empty else 1.0 / (step + 3),
        "grad_norm": None if empty else math.sqrt(step + 0.1),
        "param_norm": 1e3 + step / 7,
        "world_size": 2,
        "window_length": 4,
        "imbalance": 1.25,
        "naive_weight_error": 0.25,
    }


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_long_trace_round_trips(tmp_path: Path, suffix: str) -> None:
    """100k steps written by the real writer read back exactly; only the compared columns are kept."""
    path = tmp_path / f"long{suffix}"
    writer = TraceWriter(path)
    for step in range(LONG_TRACE_STEPS):
        writer.write(row_of(step))
    writer.close()

    trace = read_trace(path)
    assert list(trace) == [3 * step for step in range(LONG_TRACE_STEPS)]
    for step in (0, 1, 97, 4321, LONG_TRACE_STEPS - 1):
        expected = row_of(step)
        assert trace[3 * step] == {column: expected[column] for column in COMPARED_COLUMNS}


def test_order_is_checked_against_the_previous_step_at_the_end_of_a_long_trace(tmp_path: Path) -> None:
    lines = [HEADER] + [f"{step},4,1,1,1" for step in range(LONG_TRACE_STEPS)] + ["7,4,1,1,1"]
    path = tmp_path / "t.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"line {LONG_TRACE_STEPS + 2}: step 7 follows step {LONG_TRACE_STEPS - 1}"):
        read_trace(path)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_byte_order_mark_is_accepted(tmp_path: Path, suffix: str) -> None:
    """Spreadsheet programs save "CSV UTF-8" with a BOM; it must not hide the `step` column."""
    path = tmp_path / f"t{suffix}"
    writer = TraceWriter(path)
    writer.write({"step": 0, "global_count": 4, "loss": 1.5, "grad_norm": 0.5, "param_norm": 2.0})
    writer.close()
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_trace(path)[0]["loss"] == 1.5


def test_accepted_spellings(tmp_path: Path) -> None:
    """What repr() and json.dumps write, plus integer-valued steps and blank lines (hand-edited files)."""
    path = tmp_path / "t.csv"
    path.write_text(f"{HEADER}\n\n0,4,nan,inf,1e-05\n2.0,0,,1E+3, 7 \n")
    trace = read_trace(path)
    assert list(trace) == [0, 2]
    assert math.isnan(trace[0]["loss"] or 0.0) and trace[0]["grad_norm"] == math.inf
    assert trace[0]["param_norm"] == 1e-05
    assert trace[2] == {"global_count": 0.0, "loss": None, "grad_norm": 1000.0, "param_norm": 7.0}
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"step": 0, "global_count": 4, "loss": NaN, "grad_norm": -1, "param_norm": null,'
                     ' "extra": [1, {"a": 2}]}\n')
    assert read_trace(jsonl)[0]["grad_norm"] == -1.0


def test_traces_of_earlier_versions_still_read(tmp_path: Path) -> None:
    """Traces recorded before the float32 fingerprint also hold `param_sum`: it is ignored, like any extra column."""
    path = tmp_path / "old.csv"
    path.write_text("step,global_count,loss,grad_norm,param_sum,param_norm,world_size\n0,4,1.5,0.5,0.25,2.0,2\n")
    assert read_trace(path) == {0: {"global_count": 4.0, "loss": 1.5, "grad_norm": 0.5, "param_norm": 2.0}}


def jsonl_row(**values: object) -> str:
    fields = {"step": "0", "global_count": "4", "loss": "1.5", "grad_norm": "0.5", "param_norm": "2.0"}
    fields.update({key: str(value) for key, value in values.items()})
    return "{" + ", ".join(f'"{key}": {value}' for key, value in fields.items()) + "}\n"


BAD_FILES: list[tuple[str, str, bytes, str]] = [
    # (case, file name, content, what the message must say after "Malformed trace '<path>', line <n>: ")
    ("binary renamed .csv", "t.csv", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
     r"line 1: byte 0x89 at column 1 is not UTF-8"),
    ("latin-1 text", "t.csv", f"{HEADER}\n{ROW}\n1,4,1.5,0.5,2.0 caf\xe9\n".encode("latin-1"),
     r"line 3: byte 0xe9 at column 20 is not UTF-8.*binary file, or text saved as Latin-1"),
    ("NUL byte", "t.csv", f"{HEADER}\n0,4,1\x00,1,1\n".encode(), r"line 2: a NUL byte: this is a binary file"),
    ("deeply nested JSON", "t.jsonl", ("[" * 100_000 + "]" * 100_000 + "\n").encode(),
     r"line 1: JSON nested too deeply"),
    ("deeply nested value", "t.jsonl", jsonl_row(loss="[" * 100_000 + "]" * 100_000).encode(),
     r"line 1: JSON nested too deeply"),
    ("huge integer", "t.jsonl", jsonl_row(loss=10**400).encode(),
     r"line 1: column 'loss' holds an integer too large for a float"),
    ("integer past Python's digit limit", "t.jsonl", jsonl_row(loss="9" * 5000).encode(),
     r"line 1: not JSON \(Exceeds the limit"),
    ("huge step", "t.csv", f"{HEADER}\n{'9' * 400},4,1,1,1\n".encode(),
     r"line 2: `step` must be a non-negative integer, got '99999.*\(402 characters\)"),
    ("infinite count", "t.csv", f"{HEADER}\n0,inf,1,1,1\n".encode(),
     r"line 2: `global_count` must be a finite count >= 0, got inf"),
    ("count overflowing to inf", "t.csv", f"{HEADER}\n0,{'9' * 400},1,1,1\n".encode(),
     r"line 2: `global_count` must be a finite count >= 0, got inf"),
    ("NaN count", "t.jsonl", jsonl_row(global_count="NaN").encode(),
     r"line 1: `global_count` must be a finite count >= 0, got nan"),
    ("negative count", "t.csv", f"{HEADER}\n0,-4,1,1,1\n".encode(),
     r"line 2: `global_count` must be a finite count >= 0, got -4.0"),
    ("non-ASCII digits", "t.csv", f"{HEADER}\n0,\u0664,1,1,1\n".encode(),
     r"line 2: column 'global_count' holds '\u0664', not a number"),
    ("non-ASCII step", "t.csv", f"{HEADER}\n\u0663,4,1,1,1\n".encode(),
     r"line 2: `step` must be a non-negative integer, got '\u0663'"),
    ("underscore in a number", "t.csv", f"{HEADER}\n0,5_8,1,1,1\n".encode(),
     r"line 2: column 'global_count' holds '5_8', not a number"),
    ("underscore in a JSON string", "t.jsonl", jsonl_row(loss='"5_8"').encode(),
     r"line 1: column 'loss' holds '5_8', not a number"),
    ("boolean", "t.jsonl", jsonl_row(loss="true").encode(), r"line 1: column 'loss' holds True, not a number"),
    ("nested value", "t.jsonl", jsonl_row(loss='{"a": 1}').encode(),
     r"line 1: column 'loss' holds \{'a': 1\}, not a number"),
    ("boolean step", "t.jsonl", jsonl_row(step="true").encode(),
     r"line 1: `step` must be a non-negative integer, got True"),
    ("repeated column", "t.csv", f"{HEADER},loss\n0,4,1,1,1,2\n".encode(),
     r"line 1: the header names the columns \['loss'\] more than once"),
    ("lone carriage return", "t.csv", f"{HEADER}\n0,4,1,1,1\r1,4,1,1,1\n".encode(),
     r"line 2: not CSV \(new-line character seen in unquoted field"),
]


@pytest.mark.parametrize(("name", "content", "match"), [case[1:] for case in BAD_FILES],
                         ids=[case[0] for case in BAD_FILES])
def test_bad_file_names_file_and_line(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^Malformed trace {re.escape(repr(str(path)))}, {match}"):
        read_trace(path)


def test_directory_is_not_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "trace.csv").mkdir()
    with pytest.raises(IsADirectoryError, match=r"'.*trace\.csv' is a directory\. Pass the file that"):
        read_trace(tmp_path / "trace.csv")
    with pytest.raises(FileNotFoundError, match=r"'.*missing\.csv' does not exist"):
        read_trace(tmp_path / "missing.csv")
