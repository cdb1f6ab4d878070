"""Deferred mode's DDP communication hook: all-reduce each gradient bucket times D/N instead of 1/P."""

# No `from __future__ import annotations` here: DDP compares the hook's annotations with the real classes.
from typing import Any

import torch
import torch.distributed as dist

from token_mean import _torch


def scaled_allreduce_hook(
    state: Any,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """SUM-all-reduce the bucket (Σ∇(loss sums)/D) times the mode's ``gradient_factor()`` D/N: the token mean.

    NCCL scales inside the all-reduce (``PREMUL_SUM``, no pass over the gradients); gloo refuses it, so the bucket
    is scaled first. ``state`` is ``[weakref to the mode (a strong one would keep DDP and its group alive), the
    group, whether it is NCCL]``; outside a window, or once the mode is gone, the hook is DDP's mean.
    """
    reference, group, nccl = state
    mode = reference()
    factor = 1.0 / group.size() if mode is None else mode.gradient_factor()
    buffer = bucket.buffer()
    if nccl and buffer.is_cuda and isinstance(factor, torch.Tensor):
        work = dist.all_reduce(buffer, op=_torch.premul_sum(factor.to(buffer.dtype)), group=group, async_op=True)
        assert work is not None
    else:
        buffer.mul_(factor)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        assert work is not None
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda done: done.value()[0])
    return future
