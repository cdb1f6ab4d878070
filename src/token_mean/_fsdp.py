"""What the package needs of a model sharded by FSDP2 or tensor parallelism, under the Trainer and Fabric alike.

- :func:`layout`: the core's view of a ``("data_parallel", "tensor_parallel")`` mesh, for every front end (deferred
  mode's factor comes after FSDP2's reduce-scatter averaged the gradients: ``_deferred.AfterReduction``).
- :func:`check_reduction`: both modes rely on FSDP2 dividing every gradient by the data-parallel size P.
- :func:`mesh_world`: the ranks of a ``("data_parallel", "tensor_parallel")`` mesh that share a denominator.
- :class:`Outputs`: a rank whose ``training_step`` returns no loss must still run FSDP2's backward, or the other ranks
  wait in their reduce-scatter until the process group's timeout. FSDP2's backward hooks hang on the forward's
  outputs, so the outermost sharded modules' outputs of the step are kept (references, no copy), and a zero made of
  them stands in for the loss: every collective of the backward runs, and every rank raises at the window's end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.utils._pytree import tree_flatten

from token_mean import _torch
from token_mean._core import Layout
from token_mean._deferred import AfterReduction
from token_mean._record import World


def check_reduction(model: Module, data_parallel: int, owner: str) -> bool:
    """Raise unless every FSDP2 group of ``model`` averages its gradients over the ``data_parallel`` ranks; returns
    whether any module is sharded at all."""
    found = list(_torch.fsdp_reductions(model))
    for reduction in found:
        where = f"`{reduction.module}`" if reduction.module else "the root module"
        if reduction.divide_factor is not None:
            raise ValueError(
                f"`{owner}` applies the global token count itself, relying on FSDP2's default mean over the"
                f" {data_parallel} data-parallel ranks, but {where} has"
                f" `set_gradient_divide_factor({reduction.divide_factor!r})`. Remove that call."
            )
        if reduction.ranks != data_parallel:
            raise ValueError(
                f"`fully_shard` on {where} reduces gradients over {reduction.ranks} ranks, but the data-parallel"
                f" dimension of the device mesh has {data_parallel}: pass the mesh's 'data_parallel' dimension as"
                " `mesh=` to `fully_shard`."
            )
    return bool(found)


def _sharded(module: Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(module, FSDPModule) or any(
        isinstance(parameter, DTensor) for parameter in module.parameters(recurse=False)
    )


class Outputs:
    """The outputs of ``model``'s outermost sharded modules during one step, for :meth:`stand_in_loss`."""

    def __init__(self, model: Module) -> None:
        self._kept: list[Any] = []
        self._active = False
        outermost: list[Module] = []
        for module in model.modules():
            if _sharded(module) and not any(module in set(outer.modules()) for outer in outermost):
                outermost.append(module)
        self._handles = [module.register_forward_hook(self._keep) for module in outermost]

    def _keep(self, module: Module, args: Any, output: Any) -> None:
        if self._active:
            self._kept.append(output)

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Keep the outputs of the forwards that run in the block (and forget the previous block's)."""
        self._kept, self._active = [], True
        try:
            yield
        finally:
            self._active = False

    def remove(self) -> None:
        """Take the hooks off the model (the fit is over)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stand_in_loss(self) -> Tensor | None:
        """A zero whose backward runs every sharded module's backward of the step (None: no output to use)."""
        leaves = [leaf for output in self._kept for leaf in tree_flatten(output)[0]]
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.requires_grad]
        if not tensors:
            return None
        return torch.stack([tensor.sum() * 0.0 for tensor in tensors]).sum()


def mesh_world(mesh: Any, device: torch.device) -> World:
    """The data-parallel ranks of a ``("data_parallel", "tensor_parallel")`` device mesh share the denominator; the
    tensor-parallel ones hold the same batches and must count alike."""
    data_parallel, tensor_parallel = mesh["data_parallel"], mesh["tensor_parallel"]
    distributed = dist.is_available() and dist.is_initialized()
    return World(
        size=data_parallel.size(),
        rank=data_parallel.get_local_rank(),
        device=device,
        group=data_parallel.get_group() if distributed else None,
        distributed=distributed and data_parallel.size() > 1,
        replica_group=tensor_parallel.get_group() if distributed and tensor_parallel.size() > 1 else None,
        gradients_averaged=True,
    )


def layout(model: Module, mesh: Any, device: torch.device) -> Layout:
    """The core's view of ``model`` sharded over ``mesh`` (``check_reduction`` tells whether FSDP2 reduces as the
    package relies on)."""
    world = mesh_world(mesh, device)
    groups = [group for _, group in _torch.fsdp_param_groups(model)]  # found once: the walk is per module
    return Layout(world, lambda: AfterReduction(model, world.size),
                  sync_flags=lambda: _torch.fsdp_reduces_gradients(groups))  # read by FSDP2 as the backward runs


__all__ = ["Outputs", "check_reduction", "layout", "mesh_world"]
