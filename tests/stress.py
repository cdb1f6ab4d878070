"""Run every test file that starts processes many times in a row: a test that fails one run in twenty is a defect.

    .venv/bin/python tests/stress.py                       # every distributed test file, 20 consecutive runs each
    .venv/bin/python tests/stress.py --runs 5 tests/test_fabric.py tests/test_user_hooks.py
    .venv/bin/python tests/stress.py --fast                # leave out the tests marked slow (real subprocesses)

(``make stress`` runs the first.) Each run is a fresh ``python -m pytest`` of one file, bounded by ``--limit``
seconds; the process group it starts is killed when it ends, so nothing outlives a run. A file stops at its first
failing run, whose output is kept under ``--out``; the summary gives, per file, the passing runs and their times.
Exit status 0 only when every run of every file passed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTED = re.compile(r"pytest\.mark\.distributed")


def distributed_files() -> list[Path]:
    """The test files with a test marked ``distributed`` (they start processes)."""
    return sorted(path for path in (ROOT / "tests").glob("test_*.py") if DISTRIBUTED.search(path.read_text()))


NOTHING_SELECTED = 5  # pytest's exit status when no test of the file is selected (`--fast` on a file of slow tests)


def run_once(path: Path, fast: bool, limit: float, log: Path) -> tuple[int, float]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(path)]
    if fast:
        command += ["-m", "not slow"]
    started = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever the run started, its workers included
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return code, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="test files (default: every distributed one)")
    parser.add_argument("--runs", type=int, default=20, help="consecutive runs per file")
    parser.add_argument("--fast", action="store_true", help="leave out the tests marked slow")
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds one run of one file may take")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "stress", help="where failing runs' logs go")
    args = parser.parse_args()
    files = [path.resolve() for path in args.files] or distributed_files()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for path in files:
        times: list[float] = []
        for run in range(1, args.runs + 1):
            log = args.out / f"{path.stem}-run{run}.log"
            code, seconds = run_once(path, args.fast, args.limit, log)
            if code == NOTHING_SELECTED and run == 1:
                print(f"skip {path.name}: no test selected (`--fast` leaves out its tests, all marked slow)")
                log.unlink()
                break
            if code != 0:
                print(f"FAIL {path.name}: run {run} of {args.runs} failed after {len(times)} passing; see {log}")
                failed = True
                break
            log.unlink()
            times.append(seconds)
        else:
            print(f"ok   {path.name}: {args.runs} of {args.runs} runs passed, {min(times):.0f}-{max(times):.0f} s each")
        sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
