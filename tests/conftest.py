"""Shared fixtures: a clean process group and environment around every test (as Lightning's own tests do)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

# The launcher scripts run in their own processes; --doctest-modules would otherwise import them here.
collect_ignore = ["scripts"]

# The tests fork DDP workers from this process. An OpenMP pool that has run a parallel region does not survive a
# fork (the child deadlocks in its first parallel op), and the tensors here are tiny: one intra-op thread.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clean_distributed_state() -> Iterator[None]:
    env = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    torch.set_default_dtype(torch.float32)
