"""Every touch of FSDP2's internals (``torch.distributed.fsdp.fully_shard``), with the torch behaviour it relies on.

Checked on torch 2.13; a torch upgrade has this one file to check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch.nn import Module


@dataclass(frozen=True)
class Reduction:
    """How one FSDP2 parameter group reduces its gradients over data-parallel ranks."""

    module: str  # the FSDP module's qualified name ("" for the root)
    ranks: int  # the data-parallel ranks it reduces over (shard × replicate mesh sizes)
    divide_factor: float | None  # set by `set_gradient_divide_factor`; None: the mean over `ranks`


def reductions(model: Module) -> Iterator[Reduction]:
    """Each FSDP2 parameter group of ``model``: the ranks its gradients are reduced over and its divide factor.

    Relies on: ``FSDPModule._get_fsdp_state()._fsdp_param_groups`` lists the module's parameter groups; each has
    ``mesh_info`` (``shard_mesh_size`` and, under HSDP, ``replicate_mesh_size``) and ``gradient_divide_factor``;
    ``foreach_reduce`` divides the reduced gradient by that factor, or by shard × replicate size when it is None
    (``_get_gradient_divide_factors``: ``ReduceOp.AVG``, or a SUM with a pre- and post-division for float16 and
    float64), for every reduce dtype.
    """
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", ()):
            mesh_info = group.mesh_info
            ranks = getattr(mesh_info, "shard_mesh_size", 1) * getattr(mesh_info, "replicate_mesh_size", 1)
            yield Reduction(name, ranks, group.gradient_divide_factor)


__all__ = ["Reduction", "reductions"]
