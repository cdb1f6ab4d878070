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
    """SUM-all-reduce the bucket scaled by the deferred mode's ``gradient_factor()`` (D/N, on the device).

    Each rank's bucket holds Σ∇(loss sums)/D; multiplying by D/N before the SUM gives the global token mean. On NCCL
    the factor rides inside the all-reduce (``PREMUL_SUM``: no pass over the gradients at all); gloo refuses that op,
    so elsewhere the bucket is scaled in place first. ``state`` is ``[the mode training the model now (a weak
    reference: the C++ reducer holds the state, and a strong one would keep DDP and its process group alive,
    ``_exit``), DDP's process group, whether it is NCCL]`` (``_layout._install_hook``); outside a window, and once
    the mode is gone (an accumulator dropped while its model trains on), the hook is DDP's mean.
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
        work = _torch.start_all_reduce(group, buffer)
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda done: done.value()[0])
    return future
