"""Shared fixtures: a clean process group and environment around every test (as Lightning's own tests do)."""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Iterator

import _old_torch  # noqa: F401  (FSDP2 on the CPU under torch 2.6)
import pytest
import torch
import torch.distributed as dist

# The launcher scripts run in their own processes; --doctest-modules would otherwise import them here.
collect_ignore = ["scripts"]

# The tests fork DDP workers from this process. An OpenMP pool that has run a parallel region does not survive a
# fork (the child deadlocks in its first parallel op), and the tensors here are tiny: one intra-op thread.
# OMP_NUM_THREADS too: without it Lightning's launchers call torch.set_num_threads(cores // processes) themselves, in
# a forked worker and, for a one-process popen fit (tests/test_strategy.py::test_empty_windows_warn_once), in this
# process, whose 2-thread pool then hangs every later one-process fork in its first parallel op. Set before the
# fixture below snapshots the environment, so every test restores it.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# A forked worker inherits this process's uncollected garbage: earlier tests' process groups, stores and DDP models
# among it. Collecting that in the worker runs their destructors, which join threads the fork did not copy, and the
# worker waits forever. Frozen, the inherited objects are never collected in the worker; its own still are.
os.register_at_fork(after_in_child=gc.freeze)


@pytest.fixture(autouse=True)
def _clean_distributed_state() -> Iterator[None]:
    env = dict(os.environ)
    yield
    # a test that failed (or timed out) while forked workers ran leaves them behind: they would outlive the suite
    # (a worker stuck in a native call ignores SIGTERM), and multiprocessing joins them at exit
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    torch.set_default_dtype(torch.float32)
