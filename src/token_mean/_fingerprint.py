"""Fingerprints of a training step: the L2 norms of all gradients and of all parameters, from one pass each."""

from __future__ import annotations

import torch
from torch import Tensor

from token_mean import _torch

NORM_ROW = 1024
"""Elements per partial norm of a CPU tensor's fingerprint (see ``global_norm``)."""
ROW_NORM_DEVICES = ("cpu",)
"""Device types whose fingerprints are taken row by row instead of with the fused ``torch._foreach_norm``."""


def grad_norm(module: torch.nn.Module, device: torch.device) -> Tensor | None:
    return global_norm([p.grad.detach() for p in module.parameters() if p.grad is not None], device)


def global_norm(tensors: list[Tensor], device: torch.device) -> Tensor | None:
    """The L2 norm of all ``tensors`` together, a float64 tensor on ``device``, from one pass over them.

    Norms are taken in each tensor's own precision (float32 for half types, whose own norms would keep three digits)
    and only the partial norms are combined in float64. On accelerators one fused ``torch._foreach_norm`` per dtype
    (what ``clip_grad_norm_`` uses) takes all of them; its kernels add partial sums in a tree. The CPU kernel adds a
    tensor's squares one after the other instead: in float32 the norm of a 1M-element tensor is then ~1e-5 off, by a
    different amount for nearly equal parameters, which would compare rounding rather than training. On the CPU each
    tensor is therefore reduced in rows of ``NORM_ROW`` elements (one kernel per tensor, 1e-10 off). ``None``
    without tensors.

    Example:
        >>> import torch
        >>> global_norm([torch.tensor([3.0, 4.0]), torch.tensor([12.0])], torch.device("cpu"))  # √(3² + 4² + 12²)
        tensor(13., dtype=torch.float64)
    """
    if not tensors:
        return None
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
    return torch.stack(squares).sum().sqrt()


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


__all__ = ["NORM_ROW", "global_norm", "grad_norm"]
