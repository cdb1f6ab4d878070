"""Launcher jobs as the tests run them: each command in its own session, bounded in time, and the exit reports.

A job is one or more commands started together (one per torchrun node); ``run_job`` waits for all of them and then
kills whatever their sessions still hold, so nothing a launcher started can outlive the test. A launcher script
registers an :class:`ExitReport` before it trains, so that the report runs after every exit handler of the package
(last in, first out): each process that trained writes ``exit-rank{r}.json`` saying whether its default process
group was still registered, and whether the group object itself (with its gloo worker threads) still lived, as the
interpreter began to finalize.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TORCHRUN = Path(sys.executable).with_name("torchrun")
JOB_TIMEOUT = 120  # seconds: a hung job fails its test instead of freezing the suite
# what a launcher sets: a leftover one in the test's environment would make a job join the wrong rendezvous
LAUNCH_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED",
)


@contextlib.contextmanager
def _sessions() -> Iterator[list[subprocess.Popen[Any]]]:
    """A list for the processes the block starts, each in its own session: on leaving, every session is killed
    (it holds a launcher's children too) and every process reaped."""
    started: list[subprocess.Popen[Any]] = []
    try:
        yield started
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_job(commands: list[list[str]], logs: Path, timeout: float = JOB_TIMEOUT) -> None:
    """Start the commands together, wait for all, and kill whatever their sessions still hold.

    Raises:
        subprocess.CalledProcessError: for the first command that exits non-zero; its log is the ``output``.
        subprocess.TimeoutExpired: if the job is still running after `timeout` seconds.
    """
    env = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    logs.mkdir(parents=True, exist_ok=True)
    log_paths = [logs / f"job{index}.log" for index in range(len(commands))]
    with _sessions() as started:
        for command, log in zip(commands, log_paths, strict=True):
            with log.open("wb") as sink:
                started.append(
                    subprocess.Popen(
                        command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=logs, start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout
        for process in started:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    for command, process, log in zip(commands, started, log_paths, strict=True):
        if process.returncode != 0:
            raise subprocess.CalledProcessError(process.returncode, command, output=log.read_text(errors="replace"))


def run_bounded(
    command: list[str], timeout: float = JOB_TIMEOUT, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``command`` in its own session, its output in files: the script's own exit decides (a launched rank still
    tearing down cannot hold the test on a pipe, as ``subprocess.run(capture_output=True)`` would), then whatever
    the session still holds is killed.

    Raises:
        subprocess.TimeoutExpired: past ``timeout`` seconds, with what the command wrote as its output and stderr.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        timed_out = False
        with _sessions() as started:
            process = subprocess.Popen(command, stdout=out, stderr=err, text=True, cwd=cwd, start_new_session=True)
            started.append(process)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
        out.seek(0)
        err.seek(0)
        written = out.read(), err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=written[0], stderr=written[1])
    return subprocess.CompletedProcess(command, process.returncode, *written)


class ExitReport:
    """Registered with ``atexit`` before anything trains; ``trained(rank)`` once the process trained on a group.

    It runs after every handler the package registers (last in, first out) and writes ``out/exit-rank{r}.json``:
    ``process_group_alive`` (still registered with torch) and ``process_group_freed`` (the group object is gone, its
    gloo threads joined). A group that is destroyed but still referenced keeps its threads into finalization, where
    one that must take the GIL aborts the process (``token_mean._exit``).
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rank: int | None = None
        self._group: weakref.ref[Any] | None = None

    def trained(self, rank: int) -> None:
        import torch.distributed as dist

        if self.rank is None and dist.is_available() and dist.is_initialized():
            self.rank, self._group = rank, weakref.ref(dist.group.WORLD)

    def __call__(self) -> None:
        import torch.distributed as dist

        if self.rank is not None and self._group is not None:
            alive = dist.is_available() and dist.is_initialized()
            report = {"process_group_alive": alive, "process_group_freed": self._group() is None}
            (self.out / f"exit-rank{self.rank}.json").write_text(json.dumps(report))


def assert_process_group_destroyed_before_exit(out: Path, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Every training process exited with its process group destroyed and freed by the package.

    The launcher scripts never destroy it themselves; a process that finalizes with a live gloo group aborts now and
    then (SIGABRT after a finished fit), which is what made the launcher tests fail by chance. Destroyed is not
    enough: a group something still references keeps its threads, and aborts the same way (``token_mean._exit``).
    """
    reports = {rank: json.loads((out / f"exit-rank{rank}.json").read_text()) for rank in ranks}
    expected = {"process_group_alive": False, "process_group_freed": True}
    assert reports == {rank: expected for rank in ranks}, reports
