"""Reference traces (one row per optimizer step, CSV or JSON Lines, never pickle) and comparing a run with one."""

from __future__ import annotations

import csv
import json
import math
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from token_mean.results import Divergence

TRACE_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}

COMPARED_COLUMNS = ("global_count", "loss", "grad_norm", "param_norm")
"""The quantities a replay is compared on, in the order a divergence is attributed (the first differing one wins)."""

REQUIRED_COLUMNS = ("step", *COMPARED_COLUMNS)
INFO_COLUMNS = ("world_size", "window_length", "imbalance", "naive_weight_error", "audit_error")
"""Written for the reader, never compared: a scaled-out run differs in them (``audit_error`` may be empty or absent)."""

TRACE_COLUMNS = (*REQUIRED_COLUMNS, *INFO_COLUMNS)


def term_columns(terms: Sequence[str]) -> tuple[str, ...]:
    """The columns of an objective of several terms, compared like the others: ``"{term}/global_count"`` and
    ``"{term}/loss"``."""
    return tuple(f"{term}/{column}" for term in terms for column in ("global_count", "loss"))


TraceValue = float | None
TraceRow = dict[str, TraceValue]


def trace_format(path: str | os.PathLike[str], argument: str) -> str:
    """Return ``"csv"`` or ``"jsonl"`` for ``path``'s suffix; raise a ``ValueError`` naming ``argument`` otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix not in TRACE_FORMATS:
        raise ValueError(
            f"`{argument}={os.fspath(path)!r}` has the suffix {suffix!r}; a trace is CSV or JSON Lines, chosen by the"
            f" suffix: use one of {sorted(TRACE_FORMATS)} (traces are never pickled)."
        )
    return TRACE_FORMATS[suffix]


def _malformed(path: Path, line: int, problem: str) -> ValueError:
    return ValueError(f"Malformed trace {str(path)!r}, line {line}: {problem}")


def _shown(raw: object) -> str:
    """A bad value as an error message quotes it: enough to recognise it, not a binary line."""
    text = repr(raw)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"


def _number(raw: object, path: Path, line: int, column: str) -> TraceValue:
    """A cell as the writer wrote it: ``repr`` of a float or an int, or empty (``None``)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, float):
        return raw
    if isinstance(raw, int) and not isinstance(raw, bool):
        try:
            return float(raw)
        except OverflowError:
            raise _malformed(path, line, f"column {column!r} holds an integer too large for a float.") from None
    # float() also reads "5_8" as 58 and any Unicode digit ("٣" as 3): neither is something the writer wrote.
    if isinstance(raw, str) and raw.isascii() and "_" not in raw:
        try:
            return float(raw)
        except ValueError:
            pass
    raise _malformed(path, line, f"column {column!r} holds {_shown(raw)}, not a number.")


def _step(raw: object, path: Path, line: int) -> int:
    value = raw
    if isinstance(raw, (str, float)):  # an integral number: "3", "3.0", 3.0
        try:
            number = _number(raw, path, line, "step")
        except ValueError:
            number = None
        value = int(number) if number is not None and number.is_integer() else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _malformed(path, line, f"`step` must be a non-negative integer, got {_shown(raw)}.")
    return value


def _text_lines(path: Path, file: IO[bytes], writer: str) -> Iterator[str]:
    """The file's lines as text, each decoded on its own so that a bad byte is reported with its line."""
    for line_number, raw in enumerate(file, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise _malformed(
                path,
                line_number,
                f"byte {raw[error.start]:#04x} at column {error.start + 1} is not UTF-8. A trace is the UTF-8 text"
                f" `{writer}(record=...)` writes: is this a binary file, or text saved as Latin-1?",
            ) from None
        if line_number == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a BOM: spreadsheet programs write one ("CSV UTF-8"); it is not part of the first name
        if "\x00" in text:
            raise _malformed(path, line_number, "a NUL byte: this is a binary file, not a trace.")
        yield text


def _csv_rows(path: Path, file: IO[bytes], extra: Sequence[str], writer: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, the cells of ``REQUIRED_COLUMNS`` and ``extra``, "" where absent) per CSV data row."""
    reader = csv.reader(_text_lines(path, file, writer))
    try:
        header = next((row for row in reader if row), None)
        if header is None:
            return
        _check_columns(path, header, writer)
        repeated = sorted(column for column in REQUIRED_COLUMNS if header.count(column) > 1)
        if repeated:
            raise _malformed(path, reader.line_num, f"the header names the columns {repeated} more than once.")
        positions = [header.index(column) if column in header else None for column in (*REQUIRED_COLUMNS, *extra)]
        for row in reader:
            if not row:
                continue  # a blank line
            if len(row) != len(header):
                raise _malformed(
                    path, reader.line_num, f"the row does not have the {len(header)} fields of the header {header}."
                )
            yield reader.line_num, ["" if position is None else row[position] for position in positions]
    except csv.Error as error:
        raise _malformed(path, reader.line_num, f"not CSV ({error}).") from None


def _jsonl_rows(path: Path, file: IO[bytes], extra: Sequence[str], writer: str) -> Iterator[tuple[int, list[object]]]:
    """(line number, the values of ``REQUIRED_COLUMNS`` and ``extra``, None where absent) per JSON Lines row."""
    for line_number, line in enumerate(_text_lines(path, file, writer), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            raise _malformed(path, line_number, "JSON nested too deeply; a trace row is one flat object.") from None
        except ValueError as error:  # JSONDecodeError, and integers past Python's 4300-digit limit
            raise _malformed(path, line_number, f"not JSON ({error}).") from None
        if not isinstance(record, dict):
            raise _malformed(path, line_number, f"expected one JSON object per line, got {type(record).__name__}.")
        _check_columns(path, list(record), writer, line_number)
        yield line_number, [record.get(column) for column in (*REQUIRED_COLUMNS, *extra)]


def _check_columns(path: Path, columns: list[str], writer: str, line: int | None = None) -> None:
    missing = [column for column in REQUIRED_COLUMNS if column not in columns]
    if missing:
        where = "" if line is None else f", line {line}"
        raise ValueError(
            f"The trace {str(path)!r}{where} lacks the columns {missing} (it has {columns}); a reference must hold"
            f" {list(REQUIRED_COLUMNS)}. Record it with `{writer}(record=...)`."
        )


def read_trace(
    path: str | os.PathLike[str],
    argument: str = "reference",
    extra: Sequence[str] = (),
    writer: str = "DenominatorMonitor",
) -> dict[int, TraceRow]:
    """Load a trace written by ``DenominatorMonitor(record=...)``: step → ``COMPARED_COLUMNS`` and ``extra`` values,
    ``None`` where empty or absent. ``argument`` names the file in messages, ``writer`` the monitor that records one.

    Anything the writer would not have written (a UTF-8 BOM aside), a missing column, a bad ``global_count``, steps
    not increasing or no step raise a ``ValueError`` naming the file and line.

    Example:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = Path(folder.name) / "ref.csv"
        >>> writer = TraceWriter(path)
        >>> writer.write({"step": 0, "global_count": 12, "loss": 2.5, "grad_norm": 0.5, "param_norm": 3.0})
        >>> writer.close()
        >>> read_trace(path)[0]["loss"]
        2.5
        >>> folder.cleanup()
    """
    path = Path(path)
    fmt = _readable_format(path, argument, writer)
    trace: dict[int, TraceRow] = {}
    previous = -1  # no step yet: steps are >= 0
    with path.open("rb") as file:
        rows = _csv_rows(path, file, extra, writer) if fmt == "csv" else _jsonl_rows(path, file, extra, writer)
        for line, (raw_step, *raw_values) in rows:
            step = _step(raw_step, path, line)
            # Steps increase, so the previous step is the largest so far: one comparison per row, never max(trace).
            if step <= previous:
                raise _malformed(
                    path,
                    line,
                    f"step {step} follows step {previous}; steps must increase. Was the file appended to by two"
                    " runs? Record the reference again.",
                )
            trace[step] = _row(raw_values, path, line, extra)
            previous = step
    if not trace:
        raise ValueError(f"The trace {str(path)!r} holds no step. Was the reference run stopped before its first step?")
    return trace


def _readable_format(path: Path, argument: str, writer: str) -> str:
    fmt = trace_format(path, argument)
    if path.is_dir():
        raise IsADirectoryError(
            f"The {argument} trace {str(path)!r} is a directory. Pass the file that"
            f" `{writer}(record=...)` wrote, e.g. 'runs/reference/trace.csv'."
        )
    if not path.exists():
        raise FileNotFoundError(
            f"The {argument} trace {str(path)!r} does not exist. Record one first with"
            f" `{writer}(record={str(path)!r})`"
            # the monitor's `reference` is read by every rank of the run; a command line reads it once
            + (", and make it readable on every rank." if argument == "reference" else ".")
        )
    return fmt


def _row(raw_values: Sequence[object], path: Path, line: int, extra: Sequence[str]) -> TraceRow:
    columns = (*COMPARED_COLUMNS, *extra)
    row = {column: _number(raw, path, line, column) for column, raw in zip(columns, raw_values, strict=True)}
    count = row["global_count"]
    if count is None:
        raise _malformed(path, line, "`global_count` is empty.")
    if not (math.isfinite(count) and count >= 0):
        raise _malformed(path, line, f"`global_count` must be a finite count >= 0, got {count!r}.")
    return row


class TraceWriter:
    """Write one row per optimizer step to a CSV or JSON Lines file, flushed per row: a crash keeps the steps so far."""

    def __init__(self, path: str | os.PathLike[str], terms: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.columns = (*TRACE_COLUMNS, *term_columns(terms))
        is_csv = trace_format(self.path, "record") == "csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("w", newline="" if is_csv else None, encoding="utf-8")
        weakref.finalize(self, self._file.close)  # the file closes itself with its writer (or at exit)
        self._csv = csv.DictWriter(self._file, fieldnames=self.columns) if is_csv else None
        if self._csv is not None:
            self._csv.writeheader()

    def write(self, row: Mapping[str, float | int | None]) -> None:
        if self._file is None:
            raise RuntimeError(f"The trace {str(self.path)!r} is closed.")
        if self._csv is not None:
            # repr() round-trips a float exactly; None becomes an empty field.
            self._csv.writerow({name: "" if row.get(name) is None else repr(row[name]) for name in self.columns})
        else:
            self._file.write(json.dumps({column: row.get(column) for column in self.columns}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


COUNT_RTOL = 1e-9
"""N is compared almost exactly: a different count is never numerics, it is different data or a different count."""

_MISMATCHED_COUNT = (
    "a count that does not match what the loss averages over (labels shifted inside the model:"
    " `count_shifted_labels`; class weights: `ClassWeightedCount`; another ignore_index)"
)
_CAUSES = {
    "global_count": (
        "a different N at the same step means different data (order, sharding, batch size, drop_last) or a different"
        " count definition (`count_fn`: labels shifted inside the model → `count_shifted_labels`, class weights →"
        " `ClassWeightedCount`, another ignore_index)"
    ),
    "loss": (
        f"the same N with a different loss means {_MISMATCHED_COUNT}, a different loss definition or numerics"
        " (precision, kernels), or parameters that already differed (compare the previous step's param fingerprint)"
    ),
    "grad_norm": (
        f"the same N and loss with a different gradient means a different objective: {_MISMATCHED_COUNT}, plain DDP"
        " averaging per-rank means over uneven ranks, or Lightning dividing a short last window by the full"
        " `accumulate_grad_batches` (use `TokenMeanDDPStrategy`); otherwise different numerics"
    ),
    "param_norm": (
        "the same N, loss and gradient with different parameters after the update means a different optimizer,"
        " learning rate, scheduler or gradient clipping"
    ),
}


class TraceComparison:
    """A reference trace and the tolerances to compare each step of a run with it, in ``COMPARED_COLUMNS`` order."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        rtol: float,
        atol: float,
        monitor: str = "DenominatorMonitor",
        rows: dict[int, TraceRow] | None = None,
        terms: Sequence[str] = (),
    ) -> None:
        self.path = os.fspath(path)
        self.monitor = monitor  # the front end's monitor, named in messages
        self.terms = term_columns(terms)  # compared where the reference has them
        self.rows = read_trace(path, extra=self.terms, writer=monitor) if rows is None else rows
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
        # a term's columns where the reference has them (it may come from a run of one term): its N_t, its loss
        terms = [
            column for column in self.terms if reference.get(column.rpartition("/")[0] + "/global_count") is not None
        ]
        for column in (*COMPARED_COLUMNS, *terms):
            value, expected = row.get(column), reference.get(column)
            value = None if value is None else float(value)
            rtol, atol = (COUNT_RTOL, 0.0) if column.endswith("global_count") else (self.rtol, self.atol)
            if close(value, expected, rtol, atol):
                continue
            message = (
                f"{self.monitor}: step {step} diverged from the reference trace {self.path!r}: {column} is"
                f" {value!r} here but {expected!r} in the reference (tolerance {atol:g} + {rtol:g} × |reference|)."
                f" Likely cause: {_CAUSES[column.rpartition('/')[2]]}."
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
