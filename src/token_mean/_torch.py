"""Every touch of torch's (and torchmetrics') private internals, each with the behaviour it relies on: one file to
check. Checked by the suite on torch 2.6.0, 2.13.0 and 2.15.0 (torchmetrics 1.5.0 and 1.9.0); the FSDP2 ones also
read in the released sources of 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0 and 2.12.1, and where one changed in between,
its note says in which release."""

from __future__ import annotations

import array
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module


def fsdp_param_groups(model: Module) -> Iterator[tuple[str, Any]]:
    """Each FSDP2 parameter group of ``model``, with its module's name.

    Relies on: ``FSDPModule._get_fsdp_state()`` holds the groups ``fully_shard`` made: the list
    ``_fsdp_param_groups`` from torch 2.12 on (``_fsdp_param_group`` is then a property that raises for several),
    the one group or None ``_fsdp_param_group`` in 2.6 to 2.11. Read directly, so that a later rename raises here
    rather than leave a sharded model looking unsharded.
    """
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if hasattr(state, "_fsdp_param_groups"):
                groups = list(state._fsdp_param_groups)
            else:
                group = state._fsdp_param_group
                groups = [] if group is None else [group]
            for group in groups:
                yield name, group


def fsdp_reductions(model: Module) -> Iterator[tuple[str, int, float | None]]:
    """``(module name, ranks reduced over, what the reduced gradient is divided by)`` per FSDP2 parameter group; the
    divisor is None where a custom reduction keeps no readable factor.

    Relies on: a group's ``mesh_info`` (``shard_mesh_size``, under HSDP ``replicate_mesh_size``; 2.6 to 2.15) and,
    from torch 2.8 on, ``gradient_divide_factor`` (``set_gradient_divide_factor``): ``foreach_reduce`` divides by
    that factor, or by shard × replicate size when None, for every reduce dtype (``_get_gradient_divide_factors``).
    In 2.6 and 2.7 ``set_reduce_scatter_divide_factor`` instead sets ``reduce_scatter_reduce_op`` to a ``PREMUL_SUM``
    in place of the mean (the factor is not kept), and the mean is taken when that op is None.
    """
    for name, group in fsdp_param_groups(model):
        mesh_info = group.mesh_info
        ranks = getattr(mesh_info, "shard_mesh_size", 1) * getattr(mesh_info, "replicate_mesh_size", 1)
        if hasattr(group, "gradient_divide_factor"):
            factor = group.gradient_divide_factor
            yield name, ranks, float(ranks if factor is None else factor)
        else:
            yield name, ranks, None if group.reduce_scatter_reduce_op is not None else float(ranks)


def is_sharded(module: Module, recurse: bool = True) -> bool:
    """Whether FSDP2 or tensor parallelism holds ``module``'s parameters (``recurse``: or any submodule's)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    modules = module.modules() if recurse else [module]
    return any(isinstance(m, FSDPModule) for m in modules) or any(
        isinstance(p, DTensor) for p in module.parameters(recurse=recurse)
    )


def fsdp_reduces_gradients(groups: Sequence[Any]) -> list[bool]:
    """Whether each FSDP2 parameter group reduces its gradients in the next backward.

    Relies on: ``set_requires_gradient_sync`` (Fabric's ``no_backward_sync``) sets each group's ``reduce_grads``,
    which ``FSDPParamGroup.post_backward`` reads.
    """
    return [bool(group.reduce_grads) for group in groups]


def drop_fsdp_unreduced_gradients(model: Module) -> None:
    """Drop FSDP2's unreduced gradient of an unfinished window (``zero_grad()`` misses it; it would be added in).

    Relies on: ``post_backward`` without ``reduce_grads`` keeps it as ``_unsharded_param.grad`` (or, up to torch
    2.14, ``unsharded_accumulated_grad`` for another reduce dtype; 2.15 made that a read-only view of the former),
    and the next reducing one reduce-scatters it too.
    """
    for _, group in fsdp_param_groups(model):
        for parameter in group.fsdp_params:
            if not isinstance(getattr(type(parameter), "unsharded_accumulated_grad", None), property):
                parameter.unsharded_accumulated_grad = None
            unsharded = getattr(parameter, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


def fsdp_parameter_pairs(model: Module) -> list[tuple[torch.nn.Parameter, Tensor]]:
    """``(sharded, unsharded)`` per FSDP2 parameter: the DTensor the optimizer reads, and the leaf autograd records.

    Relies on: a group's ``fsdp_params``; an ``FSDPParam``'s ``sharded_param`` is the registered DTensor and its
    ``_unsharded_param`` one object from the first all-gather on (resharding frees only its storage).
    ``post_backward`` reduce-scatters only a ``.grad`` set on it (none: nothing, or zeros with
    ``reduce_scatter_unused_params``).
    """
    return [
        (parameter.sharded_param, parameter._unsharded_param)
        for _, group in fsdp_param_groups(model)
        for parameter in group.fsdp_params
        if getattr(parameter, "_unsharded_param", None) is not None  # None until the first forward
    ]


def multiply_(tensors: list[Tensor], factor: Tensor) -> None:
    """``tensors *= factor`` in one fused kernel per device and dtype.

    Relies on: ``torch._foreach_mul_(list, Tensor)`` scales in place by a 0-dim tensor on their device.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for (device, dtype), group in groups.items():
            torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))


def norms(tensors: list[Tensor], dtype: torch.dtype | None) -> tuple[Tensor, ...]:
    """Each tensor's L2 norm from one ``torch._foreach_norm`` kernel, in ``dtype`` (None: the tensors' own)."""
    # `dtype=` only where needed: it came in torch ~2.5
    return tuple(torch._foreach_norm(tensors, 2) if dtype is None else torch._foreach_norm(tensors, 2, dtype=dtype))


def premul_sum(factor: Tensor) -> Any:
    """NCCL's ``PREMUL_SUM`` op: the all-reduce multiplies by ``factor`` (a device tensor) as it sums.

    Relies on: ``dist._make_nccl_premul_sum(factor)``; NCCL only (gloo raises).
    """
    return dist._make_nccl_premul_sum(factor)  # type: ignore[attr-defined]


def to_device(values: list[float] | list[int] | array.array[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host values on ``device`` without making the host wait for the device's queued work.

    Relies on: a non-blocking CUDA copy from pinned memory returns at once (from pageable memory it may wait), and
    the caching host allocator keeps the pinned block until the copy is done.
    """
    if dtype is torch.float64:  # through a C array: a third of `torch.tensor(list)`'s host time (it owns the memory)
        host = torch.frombuffer(
            values if isinstance(values, array.array) else array.array("d", values), dtype=torch.float64
        )
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def memory(tensors: list[Tensor]) -> tuple[tuple[tuple[int, int, int, int], ...], tuple[tuple[int, int], ...]]:
    """The bytes each tensor's elements reach, ``(start, end, id, version)`` (empty ones left out; non-negative
    strides), and every tensor's ``(id, version)`` in order: one call per batch read.

    Relies on: ``Tensor._version`` as :func:`version` says.
    """
    spans = []
    fingerprint = []
    for tensor in tensors:  # a loop, no intermediate lists: this runs for every batch read
        start, key = tensor.data_ptr(), (id(tensor), tensor._version)
        stop = start + (tensor.nbytes if tensor.is_contiguous() else _extent(tensor))
        fingerprint.append(key)
        if start != stop:
            spans.append((start, stop, *key))
    return tuple(spans), tuple(fingerprint)


def fingerprint(tensors: list[Tensor]) -> tuple[tuple[int, int], ...]:
    """Every tensor's ``(id, version)``, in order (:func:`memory`'s second part).

    Relies on: ``Tensor._version`` as :func:`version` says.
    """
    return tuple([(id(tensor), tensor._version) for tensor in tensors])


def _extent(tensor: Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return (reach + 1) * tensor.element_size()


def shadow_ddp_backward(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Join, with zero gradients, the gradient all-reduces of one DDP backward that the other ranks are running.

    Relies on: ``_match_all_reduce_for_bwd_pass`` (DDP ``join()``'s): one all-reduce of zeros per bucket, through
    the comm hook, in bucket order; then ``_match_unused_params_allreduce`` with ``find_unused_parameters``.
    """
    model._match_all_reduce_for_bwd_pass()  # type: ignore[no-untyped-call]
    if model.find_unused_parameters:
        model._match_unused_params_allreduce()  # type: ignore[no-untyped-call]


def ddp_ignored(model: torch.nn.parallel.DistributedDataParallel) -> set[str]:
    """The parameter names DDP was told to leave alone (``_set_params_and_buffers_to_ignore_for_model``).

    Relies on: ``DistributedDataParallel.parameters_to_ignore``, read when DDP builds its reducer over the
    parameters that then require a gradient.
    """
    return set(getattr(model, "parameters_to_ignore", ()) or ())


def version(tensor: Tensor) -> int:
    """The tensor's version counter.

    Relies on: ``Tensor._version``, shared with its views, bumped by in-place ops and ``copy_`` (not by NumPy writes).
    """
    return tensor._version


@contextlib.contextmanager
def metrics_kept(module: Module) -> Iterator[None]:
    """Every torchmetrics ``Metric`` in ``module`` as it was, after whatever a replayed ``training_step`` updated.

    Relies on: a metric's states are the attributes its ``_defaults`` names (``metric_state``), and its update count,
    computed value and forward cache are ``_update_count``, ``_computed`` and ``_forward_cache``.
    """
    from torchmetrics import Metric

    def copied(value: Any) -> Any:
        return [v.clone() for v in value] if isinstance(value, list) else value.clone()

    saved = [
        (
            metric,
            {name: copied(value) for name, value in metric.metric_state.items()},
            metric._update_count,
            metric._computed,
            metric._forward_cache,
        )
        for metric in module.modules()
        if isinstance(metric, Metric)
    ]
    try:
        yield
    finally:
        for metric, states, count, computed, cache in saved:
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed, metric._forward_cache = count, computed, cache
