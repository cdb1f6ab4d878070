"""Reference traces: one row per optimizer step, as CSV or JSON Lines (never pickle: loading a trace runs no code)."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

TRACE_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
"""File suffix → trace format."""

COMPARED_COLUMNS = ("global_count", "loss", "grad_norm", "param_sum", "param_norm")
"""The quantities a replay is compared on, in the order a divergence is attributed (the first differing one wins)."""

REQUIRED_COLUMNS = ("step", *COMPARED_COLUMNS)
INFO_COLUMNS = ("world_size", "window_length", "imbalance", "naive_weight_error")
"""Written for the reader, never compared: they legitimately differ between a reference and a scaled-out run."""

TRACE_COLUMNS = (*REQUIRED_COLUMNS, *INFO_COLUMNS)

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


def _parse_value(raw: Any, path: Path, line: int, column: str) -> TraceValue:
    if raw is None or raw == "":
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"Malformed trace {str(path)!r}, line {line}: column {column!r} holds {raw!r}, not a number.")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(
            f"Malformed trace {str(path)!r}, line {line}: column {column!r} holds {raw!r}, not a number."
        ) from None


def _records(path: Path, fmt: str) -> list[tuple[int, Mapping[str, Any]]]:
    """(line number, raw record) pairs, with the columns checked against ``REQUIRED_COLUMNS``."""
    records: list[tuple[int, Mapping[str, Any]]] = []
    with path.open(newline="" if fmt == "csv" else None, encoding="utf-8") as file:
        if fmt == "csv":
            reader = csv.DictReader(file)
            columns = list(reader.fieldnames or [])
            _check_columns(path, columns)
            for row in reader:
                if None in row or None in row.values():
                    raise ValueError(
                        f"Malformed trace {str(path)!r}, line {reader.line_num}: the row does not have the"
                        f" {len(columns)} fields of the header {columns}."
                    )
                records.append((reader.line_num, row))
            return records
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"Malformed trace {str(path)!r}, line {line_number}: not JSON ({error}).") from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"Malformed trace {str(path)!r}, line {line_number}: expected one JSON object per line, got"
                    f" {type(record).__name__}."
                )
            _check_columns(path, list(record), line_number)
            records.append((line_number, record))
    return records


def _check_columns(path: Path, columns: list[str], line: int | None = None) -> None:
    missing = [column for column in REQUIRED_COLUMNS if column not in columns]
    if missing:
        where = "" if line is None else f", line {line}"
        raise ValueError(
            f"The trace {str(path)!r}{where} lacks the columns {missing} (it has {columns}); a reference must hold"
            f" {list(REQUIRED_COLUMNS)}. Record it with `DenominatorMonitor(record=...)`."
        )


def read_trace(path: str | os.PathLike[str]) -> dict[int, TraceRow]:
    """Load a trace written by ``DenominatorMonitor(record=...)``: step → the row's numbers (``None`` where empty).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the suffix is not a trace format, a required column is missing, a value is not a number, the
            steps are not integers in increasing order, or the file holds no step.
    """
    path = Path(path)
    fmt = trace_format(path, "reference")
    if not path.is_file():
        raise FileNotFoundError(
            f"The reference trace {str(path)!r} does not exist. Record one first with"
            f" `DenominatorMonitor(record={str(path)!r})`, and make it readable on every rank."
        )
    trace: dict[int, TraceRow] = {}
    for line, record in _records(path, fmt):
        row = {column: _parse_value(record.get(column), path, line, column) for column in TRACE_COLUMNS}
        step = row.pop("step")
        if step is None or not math.isfinite(step) or step != int(step) or step < 0:
            raise ValueError(
                f"Malformed trace {str(path)!r}, line {line}: `step` must be a non-negative integer, got"
                f" {record.get('step')!r}."
            )
        if trace and int(step) <= max(trace):
            raise ValueError(
                f"Malformed trace {str(path)!r}, line {line}: step {int(step)} follows step {max(trace)}; steps must"
                " increase. Was the file appended to by two runs? Record the reference again."
            )
        if row["global_count"] is None:
            raise ValueError(f"Malformed trace {str(path)!r}, line {line}: `global_count` is empty.")
        trace[int(step)] = row
    if not trace:
        raise ValueError(f"The trace {str(path)!r} holds no step. Was the reference run stopped before its first step?")
    return trace


class TraceWriter:
    """Write one row per optimizer step to a CSV or JSON Lines file, flushed per row: a crash keeps the steps so far."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._format = trace_format(self.path, "record")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        newline = "" if self._format == "csv" else None
        self._file: IO[str] | None = self.path.open("w", newline=newline, encoding="utf-8")
        self._csv: Any = None
        if self._format == "csv":
            self._csv = csv.DictWriter(self._file, fieldnames=TRACE_COLUMNS)
            self._csv.writeheader()

    def write(self, row: Mapping[str, float | int | None]) -> None:
        if self._file is None:
            raise RuntimeError(f"The trace {str(self.path)!r} is closed.")
        if self._csv is not None:
            # repr() round-trips a float exactly; None becomes an empty field.
            self._csv.writerow({name: "" if row.get(name) is None else repr(row[name]) for name in TRACE_COLUMNS})
        else:
            self._file.write(json.dumps({column: row.get(column) for column in TRACE_COLUMNS}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = [
    "COMPARED_COLUMNS",
    "REQUIRED_COLUMNS",
    "TRACE_COLUMNS",
    "TraceRow",
    "TraceWriter",
    "read_trace",
    "trace_format",
]
