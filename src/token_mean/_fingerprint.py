"""Fingerprints of a training step: the L2 norms of all gradients and of all parameters, from one pass each."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean import _torch

NORM_ROW = 1024
"""Elements per partial norm on the devices in ``ROW_NORM_DEVICES`` (see ``global_norm``)."""
ROW_NORM_DEVICES = ("cpu",)


def grad_norm(module: torch.nn.Module, device: torch.device) -> Tensor | None:
    return global_norm([p.grad.detach() for p in module.parameters() if p.grad is not None], device)


def global_norm(tensors: list[Tensor], device: torch.device) -> Tensor | None:
    """The L2 norm of all ``tensors`` together, a float64 tensor on ``device`` (``None`` without tensors).

    Each tensor is normed in its own precision (float32 for half types) and the partial norms combined in float64:
    on accelerators by one fused ``torch._foreach_norm`` per dtype; on the CPU, whose kernel sums squares serially
    (~1e-5 off in float32 for 1M elements), in rows of ``NORM_ROW`` elements (1e-10 off). DTensors are normed per
    shard and combined in one all-reduce: every rank must then call this, with its shards of the same tensors.

    Example:
        >>> import torch
        >>> global_norm([torch.tensor([3.0, 4.0]), torch.tensor([12.0])], torch.device("cpu"))  # √(3² + 4² + 12²)
        tensor(13., dtype=torch.float64)
    """
    if not tensors:
        return None
    by_share = _local_shares(tensors)
    if by_share is None:
        return torch.stack(_squares(tensors, device)).sum().sqrt()
    # A sharded tensor's square sum is the sum of its shards' over the ranks; a shard held by r ranks weighs 1/r on
    # each, so one SUM all-reduce over the world adds every distinct shard once.
    total = torch.stack([torch.stack(_squares(group, device)).sum() * share for share, group in by_share.items()]).sum()
    dist.all_reduce(total)
    return total.sqrt()


def _squares(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """The square sums of ``tensors``, float64 on ``device``, in no particular order."""
    squares: list[Tensor] = []
    fused: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        if tensor.device.type in ROW_NORM_DEVICES:
            squares.append(_row_norms(tensor).to(device=device, dtype=torch.float64).square().sum())
        else:
            fused.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for (_, dtype), group in fused.items():
        norms = _torch.norms(group, _norm_dtype(dtype))
        squares.extend(norm.to(device=device, dtype=torch.float64).square() for norm in norms)
    return squares


def _local_shares(tensors: list[Tensor]) -> dict[float, list[Tensor]] | None:
    """The tensors as this rank holds them, by their square sum's weight in a SUM over the world (None: no DTensor)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(tensor, DTensor) for tensor in tensors):
        return None
    world = dist.get_world_size()
    by_share: dict[float, list[Tensor]] = {}
    for tensor in tensors:
        shards = 1
        if isinstance(tensor, DTensor):
            # Shard, and _StridedShard (FSDP2 over a tensor-parallel shard, not `is_shard()`), split the tensor
            sharded = [dim for dim, placement in enumerate(tensor.placements) if not placement.is_replicate()]
            shards = math.prod(tensor.device_mesh.size(dim) for dim in sharded)
            tensor = tensor.to_local()
        by_share.setdefault(shards / world, []).append(tensor)
    return by_share


def _norm_dtype(dtype: torch.dtype) -> torch.dtype | None:
    return torch.float32 if dtype.itemsize < 4 else None


def _row_norms(tensor: Tensor) -> Tensor:
    """Norms of ``NORM_ROW``-element rows of the flattened tensor (views, no copy), and of the remainder."""
    flat = tensor.reshape(-1)
    rows = flat.numel() // NORM_ROW
    dtype = _norm_dtype(tensor.dtype)
    body: Tensor = torch.linalg.vector_norm(flat[: rows * NORM_ROW].view(rows, NORM_ROW), dim=1, dtype=dtype)
    tail: Tensor = torch.linalg.vector_norm(flat[rows * NORM_ROW :], dtype=dtype)
    return torch.cat((body, tail.reshape(1)))
