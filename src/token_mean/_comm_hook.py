"""Deferred mode's DDP communication hook: all-reduce each gradient bucket times D/N instead of 1/P."""

# No `from __future__ import annotations` here: DDP compares the hook's annotations with the real classes.
from typing import Any

import torch
import torch.distributed as dist


def scaled_allreduce_hook(
    state: Any,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """SUM-all-reduce the bucket scaled by ``state._window.grad_factor``.

    Each rank's bucket holds Σ∇(loss sums)/D; multiplying by D/N before the SUM gives the global token mean with no
    extra pass over the gradients. ``state`` is the strategy; outside a window the hook is DDP's plain mean.
    """
    window = state._window
    factor = window.grad_factor if window is not None else 1.0 / dist.get_world_size()
    buffer = bucket.buffer().mul_(factor)
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda done: done.value()[0])
    return future
