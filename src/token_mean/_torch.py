"""Every touch of torch's private internals, each with the torch (2.13) behaviour it relies on.

A torch upgrade has this one file to check.
"""

from __future__ import annotations

import array
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module


def fsdp_param_groups(model: Module) -> Iterator[tuple[str, Any]]:
    """Each FSDP2 parameter group of ``model``, with the name of the module that holds it.

    Relies on: ``fully_shard`` makes each module's groups, and ``FSDPModule._get_fsdp_state()._fsdp_param_groups``
    lists them.
    """
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", ()):
                yield name, group


def fsdp_reductions(model: Module) -> Iterator[tuple[str, int, float | None]]:
    """Each FSDP2 parameter group of ``model``: the name of the module that holds it, the data-parallel ranks its
    gradients are reduced over, and its divide factor (None: the mean over those ranks).

    Relies on: each parameter group has ``mesh_info`` (``shard_mesh_size`` and, under HSDP, ``replicate_mesh_size``)
    and ``gradient_divide_factor``; ``foreach_reduce`` divides the reduced gradient by that factor, or by shard ×
    replicate size when it is None (``_get_gradient_divide_factors``: ``ReduceOp.AVG``, or a SUM with a pre- and
    post-division for float16 and float64), for every reduce dtype.
    """
    for name, group in fsdp_param_groups(model):
        mesh_info = group.mesh_info
        ranks = getattr(mesh_info, "shard_mesh_size", 1) * getattr(mesh_info, "replicate_mesh_size", 1)
        yield name, ranks, group.gradient_divide_factor


def is_sharded(module: Module, recurse: bool = True) -> bool:
    """Whether FSDP2 or tensor parallelism holds ``module``'s parameters (``recurse``: or any submodule's)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    modules = module.modules() if recurse else [module]
    return any(isinstance(m, FSDPModule) for m in modules) or any(
        isinstance(p, DTensor) for p in module.parameters(recurse=recurse))


def fsdp_reduces_gradients(groups: Sequence[Any]) -> list[bool]:
    """Whether each FSDP2 parameter group in ``groups`` reduces its gradients in the next backward.

    Relies on: ``set_requires_gradient_sync`` (and Fabric's ``no_backward_sync``) sets ``reduce_grads`` on every
    parameter group, and ``FSDPParamGroup.post_backward`` reads it when the backward runs.
    """
    return [bool(group.reduce_grads) for group in groups]


def drop_fsdp_unreduced_gradients(model: Module) -> None:
    """Drop what FSDP2 holds of backwards that did not reduce (``set_requires_gradient_sync(False)``): the partial
    gradient of a window left unfinished, which ``optimizer.zero_grad()`` does not reach and the next reducing
    backward would add in. A no-op for a model without FSDP2 modules.

    Relies on: ``FSDPParamGroup.post_backward`` with ``reduce_grads`` False keeps each ``FSDPParam``'s gradient as
    ``_unsharded_param.grad`` (or, for another reduce dtype, ``unsharded_accumulated_grad``), and the next reducing
    ``post_backward`` reduce-scatters it with the new one.
    """
    for _, group in fsdp_param_groups(model):
        for parameter in group.fsdp_params:
            parameter.unsharded_accumulated_grad = None
            unsharded = getattr(parameter, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


def fsdp_parameter_pairs(model: Module) -> list[tuple[torch.nn.Parameter, Tensor]]:
    """``(sharded, unsharded)`` for every parameter FSDP2 manages in ``model``: the DTensor registered on the module
    between forwards, whose ``.grad`` the optimizer reads, and the tensor registered in its place during forward and
    backward, the leaf autograd records.

    Relies on: a parameter group's ``fsdp_params`` lists its ``FSDPParam``s; an ``FSDPParam``'s ``sharded_param`` is
    the registered DTensor and its ``_unsharded_param`` is created at the first all-gather and kept as one object
    (resharding frees its storage, the next all-gather refills it). Only a ``.grad`` set on the unsharded parameter
    is reduce-scattered by ``FSDPParamGroup.post_backward``: with none, it reduces nothing (unless
    ``reduce_scatter_unused_params``, which reduces zeros) and only reshards.
    """
    return [
        (parameter.sharded_param, parameter._unsharded_param)
        for _, group in fsdp_param_groups(model)
        for parameter in group.fsdp_params
        if getattr(parameter, "_unsharded_param", None) is not None  # None until the first forward
    ]


def multiply_(tensors: list[Tensor], factor: Tensor) -> None:
    """``tensors *= factor`` in one fused kernel per device and dtype (what ``clip_grad_norm_`` uses).

    Relies on: ``torch._foreach_mul_(list, Tensor)`` scales each tensor in place by a 0-dim tensor on their device.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for (device, dtype), group in groups.items():
            torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))


def norms(tensors: list[Tensor], dtype: torch.dtype | None) -> tuple[Tensor, ...]:
    """The L2 norm of each tensor from one fused kernel (``torch._foreach_norm``, as ``clip_grad_norm_`` takes it),
    accumulated in ``dtype`` (None: the tensors' own)."""
    # `dtype=` only where needed: it came in torch ~2.5
    return tuple(torch._foreach_norm(tensors, 2) if dtype is None else torch._foreach_norm(tensors, 2, dtype=dtype))


def start_all_reduce(group: Any, tensor: Tensor, op: Any = None) -> Any:
    """Start an all-reduce of ``tensor`` (SUM unless ``op``) over ``group`` (a ``ProcessGroup``; None: the default
    group) and return its work, without the Python checks of ``dist.all_reduce`` (tens of microseconds a call: the
    window's record and deferred's comm hook, per bucket, start one).

    Relies on: ``ProcessGroup.allreduce(list[Tensor], AllreduceOptions)`` starts the collective (what
    ``dist.all_reduce`` calls after its checks, with ``asyncOp`` True by default); ``dist.group.WORLD`` is the
    default group.
    """
    options = dist.AllreduceOptions()
    if op is not None:
        options.reduceOp = op
    target: Any = dist.group.WORLD if group is None else group  # WORLD is typed Optional: set once initialized
    return target.allreduce([tensor], options)


def premul_sum(factor: Tensor) -> Any:
    """NCCL's ``PREMUL_SUM`` reduce op with ``factor`` (a device tensor): the all-reduce multiplies as it sums.

    Relies on: ``dist._make_nccl_premul_sum(factor)``; NCCL only (gloo raises "Cannot use ReduceOp.PREMUL_SUM").
    """
    return dist._make_nccl_premul_sum(factor)  # type: ignore[attr-defined]


def to_device(values: list[float] | list[int] | array.array[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host values on ``device`` without making the host wait for the device's queued work.

    Relies on: a CUDA copy from pinned host memory with ``non_blocking=True`` is queued on the current stream and
    returns at once (from pageable memory, or ``torch.tensor(..., device=cuda)``, it may wait for the stream); the
    caching host allocator keeps the pinned block until the copy is done.
    """
    if dtype is torch.float64:  # through a C array: a third of `torch.tensor(list)`'s host time (it owns the memory)
        host = torch.frombuffer(values if isinstance(values, array.array) else array.array("d", values),
                                dtype=torch.float64)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def memory(tensor: Tensor) -> tuple[int, int, int]:
    """The bytes ``[data_ptr, data_ptr + extent)`` the tensor's elements reach (its strides included; non-negative
    strides; an empty tensor reaches none) and its :func:`version`: what the reader notes of every tensor it reads,
    in one call (it runs for each tensor of each batch).

    Relies on: ``Tensor._version`` as :func:`version` says.
    """
    start = tensor.data_ptr()
    return start, start + (tensor.nbytes if tensor.is_contiguous() else _extent(tensor)), tensor._version


def _extent(tensor: Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return (reach + 1) * tensor.element_size()


def shadow_ddp_backward(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Join, with zero gradients, the gradient all-reduces of one DDP backward that the other ranks are running.

    Relies on: ``DistributedDataParallel._match_all_reduce_for_bwd_pass``, what DDP's uneven-inputs ``join()`` runs
    for a rank that has run out: one all-reduce per bucket, of zeros, through the registered communication hook, in
    the reducer's bucket order; then, with ``find_unused_parameters``, ``_match_unused_params_allreduce``.
    """
    model._match_all_reduce_for_bwd_pass()  # type: ignore[no-untyped-call]
    if model.find_unused_parameters:
        model._match_unused_params_allreduce()  # type: ignore[no-untyped-call]


def ddp_ignored(model: torch.nn.parallel.DistributedDataParallel) -> set[str]:
    """The parameter names DDP was told to leave alone (``_set_params_and_buffers_to_ignore_for_model``).

    Relies on: ``DistributedDataParallel.parameters_to_ignore``, the set of those names, read when DDP builds its
    reducer over the parameters that require a gradient at that time.
    """
    return set(getattr(model, "parameters_to_ignore", ()) or ())


def version(tensor: Tensor) -> int:
    """The tensor's version counter: every in-place change of it (or of a view of its storage) increments it.

    Relies on: ``Tensor._version``, autograd's counter, shared by a tensor and its views and bumped by in-place ops
    and ``copy_`` (not by writes through a NumPy array or a raw pointer).
    """
    return tensor._version


__all__ = [
    "ddp_ignored",
    "drop_fsdp_unreduced_gradients",
    "fsdp_param_groups",
    "fsdp_parameter_pairs",
    "fsdp_reduces_gradients",
    "fsdp_reductions",
    "is_sharded",
    "memory",
    "multiply_",
    "norms",
    "premul_sum",
    "shadow_ddp_backward",
    "start_all_reduce",
    "to_device",
    "version",
]
