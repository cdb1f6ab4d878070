"""Which ranks share one denominator (:func:`shared_world`, the one place that decides it for every user), and how
deferred mode's factor reaches their gradients (:func:`layout`): under DDP it rides in DDP's bucket all-reduce (a
communication hook); under FSDP2 or on one device the reduction has averaged the gradients, so the local shards are
multiplied by P·D/N after the window's last backward."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten

from token_mean import _torch
from token_mean._comm_hook import scaled_allreduce_hook
from token_mean._problems import Problem

WindowCheck = Callable[[], list[tuple[Problem, str]]]
"""A host-side check run as each window closes: the problems it found, each with this rank's detail."""


@dataclass(frozen=True)
class World:
    """The ranks that share one denominator (``size`` and ``rank`` count the data-parallel ones), and where their
    collective tensors live."""

    size: int
    rank: int
    device: torch.device
    group: Any | None = None  # reduces over the ranks (None: the default group)
    distributed: bool = False
    replica_group: Any | None = None  # tensor-parallel ranks training on this rank's batches: they must count alike
    gradients_averaged: bool = False  # FSDP2 averages with no hook of ours: a provisional scale is alike on all ranks
    divide_factor: float | None = None  # what that reduction divides the ranks' sum by, where not P

    @property
    def divisor(self) -> float:
        """What the gradient reduction divides the ranks' sum by: the loss scale is divisor·n/N."""
        return float(self.size) if self.divide_factor is None else self.divide_factor

    @staticmethod
    def single(device: torch.device | None = None) -> World:
        """One process, no collective."""
        return World(size=1, rank=0, device=device or torch.device("cpu"))


def shared_world(strategy: Any, model: Module | None) -> World:
    """The ranks that share the denominator of ``model`` under a Trainer or Fabric ``strategy``: one device trains
    alone; a device mesh gives its data-parallel ranks; a DDP model those of DDP's own group (counts add up where
    gradients do); any other model the default group's."""
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy as FabricModelParallel
    from lightning.fabric.strategies.single_device import SingleDeviceStrategy as FabricSingleDevice
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

    device = strategy.root_device
    if isinstance(strategy, (SingleDeviceStrategy, FabricSingleDevice)):
        return World.single(device)
    if isinstance(strategy, (ModelParallelStrategy, FabricModelParallel)):
        return _mesh_world(strategy.device_mesh, device)
    if not (dist.is_available() and dist.is_initialized()):
        return World.single(device)
    group = model.process_group if isinstance(model, DistributedDataParallel) else None
    size = dist.get_world_size(group)
    return World(size, dist.get_rank(group), device, group, distributed=True) if size > 1 else World.single(device)


def _mesh_world(mesh: Any, device: torch.device) -> World:
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


def _nothing(*args: Any) -> None:
    return None


@dataclass(frozen=True)
class Layout:
    """What a parallel layout gives the modes, under any front end."""

    world: World  # the ranks that share N
    install: Callable[[Any], None] = _nothing  # makes deferred mode's factor reach the reduction
    after_backward: Callable[[Callable[[], Tensor]], None] = _nothing  # applies D/N after the window's last backward
    checks: Sequence[WindowCheck] = ()  # run as each window closes
    join_backward: Callable[[], None] | None = None  # run when a collective finds others at a window's end
    sync_flags: Callable[[], Sequence[bool]] = tuple  # the next backward's gradient sync flags


def layout(strategy: Any, model: Module) -> Layout:
    """The modes' view of ``model`` as the strategy wrapped it (DDP, an FSDP2-sharded module, a plain module)."""
    world = shared_world(strategy, model)
    if isinstance(model, DistributedDataParallel):
        return Layout(
            world,
            lambda mode: _install_hook(model, mode),
            checks=[_unreduced_parameters(model)],
            join_backward=lambda: _torch.shadow_ddp_backward(model),
            sync_flags=lambda: (model.require_forward_param_sync,),
        )  # what the forward prepared
    return unhooked_layout(model, world)


def unhooked_layout(model: Module, world: World) -> Layout:
    """The layout of a model whose reduction (FSDP2's, or none on one device) divides the ranks' sum with no hook of
    ours."""
    groups = [group for _, group in _torch.fsdp_param_groups(model)]  # found once: the walk is per module
    divisors = {divisor for _, _, divisor in _torch.fsdp_reductions(model)}
    if len(divisors) == 1 and None not in divisors:  # else refused by check_reduction before the first window
        world = replace(world, divide_factor=divisors.pop())
    return Layout(
        world,
        after_backward=lambda factor: _multiply_shards(model, factor, world.divisor),
        sync_flags=lambda: _torch.fsdp_reduces_gradients(groups),
    )  # read by FSDP2 as the backward runs


def _multiply_shards(model: Module, factor: Callable[[], Tensor], divisor: float) -> None:
    """The local shards, Σ∇(loss sums)/(P·D) after the averaging reduction, times P·D/N in one fused kernel."""
    from torch.distributed.tensor import DTensor

    shards = [
        grad.to_local() if isinstance(grad, DTensor) else grad
        for grad in (parameter.grad for parameter in model.parameters())
        if grad is not None
    ]
    if shards:
        _torch.multiply_(shards, factor() * divisor)


_HOOK_STATE = "_token_mean_hook_state"


def _install_hook(model: DistributedDataParallel, mode: Any) -> None:
    """Register deferred's hook (Lightning's ``ddp_comm_hook`` is CUDA-only). DDP keeps one hook per model for good: a
    later deferred mode takes over its state, which holds the mode weakly (a strong reference would make a cycle
    through the C++ reducer that ``gc`` never frees) and whether the backend is NCCL, asked once."""
    state = getattr(model, _HOOK_STATE, None)
    if isinstance(state, list):
        state[0] = weakref.ref(mode)
        return
    state = [weakref.ref(mode), model.process_group, dist.get_backend(model.process_group) == "nccl"]
    try:
        model.register_comm_hook(state, scaled_allreduce_hook)
    except RuntimeError as error:
        raise ValueError(
            "`mode='deferred'` folds its factor into DDP's gradient all-reduce with a communication hook, but the"
            f" model already has one ({error}): remove your own `register_comm_hook`, or use `mode='lookahead'`."
        ) from error
    object.__setattr__(model, _HOOK_STATE, state)


def _unreduced_parameters(model: DistributedDataParallel) -> WindowCheck:
    """A check for parameters unfrozen after DDP wrapped the model (``BaseFinetuning``): DDP never reduces them, so
    the replicas drift apart. Costs a host read of ``requires_grad`` per frozen parameter and window."""
    ignored = _torch.ddp_ignored(model)
    frozen = [
        (name, parameter)
        for name, parameter in model.module.named_parameters()
        if not parameter.requires_grad and name not in ignored
    ]

    def check() -> list[tuple[Problem, str]]:
        unfrozen = [name for name, parameter in frozen if parameter.requires_grad]
        if not unfrozen:
            return []
        more = f" and {len(unfrozen) - 1} more" if len(unfrozen) > 1 else ""
        return [
            (
                Problem.UNREDUCED_PARAMETER,
                f"`{unfrozen[0]}`{more} required no gradient when DDP wrapped the model and requires one now",
            )
        ]

    return check


def check_reduction(model: Module, data_parallel: int, owner: str) -> bool:
    """Whether any module of ``model`` is sharded; a ``ValueError`` unless every FSDP2 group reduces its gradients
    over the ``data_parallel`` ranks and all divide their sum by one readable factor: the loss scale is that factor
    times n/N."""
    found = list(_torch.fsdp_reductions(model))
    for module, ranks, divisor in found:
        where = f"`{module}`" if module else "the root module"
        if divisor is None:
            raise ValueError(
                f"`{owner}` scales each loss by the factor FSDP2 divides the reduced gradients by, but {where} has"
                " `set_reduce_scatter_divide_factor(...)`, whose factor torch < 2.8 does not keep. Remove that call,"
                " or upgrade torch to 2.8 or later, where `set_gradient_divide_factor` is supported."
            )
        if not (math.isfinite(divisor) and divisor > 0):
            raise ValueError(
                f"`set_gradient_divide_factor({divisor!r})` on {where}: a reduced gradient divided by it cannot be"
                " scaled back to the token mean. Pass a positive finite factor, or remove the call."
            )
        if ranks != data_parallel:
            raise ValueError(
                f"`fully_shard` on {where} reduces gradients over {ranks} ranks, but the data-parallel dimension of"
                f" the device mesh has {data_parallel}: pass the mesh's 'data_parallel' dimension as `mesh=` to"
                " `fully_shard`."
            )
    divisors = {module or "the root module": divisor for module, _, divisor in found}
    if len(set(divisors.values())) > 1:
        shown = ", ".join(f"`{module}` by {divisor:g}" for module, divisor in divisors.items())
        raise ValueError(
            f"`{owner}` scales each loss by the one factor FSDP2 divides the reduced gradients by, but the FSDP2"
            f" modules divide by different factors ({shown}): call `set_gradient_divide_factor` with the same"
            " factor on every `fully_shard` module, or on none."
        )
    return bool(found)


def stand_in_loss(module: Module) -> Tensor:
    """A zero touching every trainable parameter, so that DDP's reducer fires on a rank whose step gave no loss."""
    return torch.stack([p.sum() * 0.0 for p in module.parameters() if p.requires_grad]).sum()


class Outputs:
    """The outputs of ``model``'s outermost sharded modules in one step: a zero made of them stands in for a missing
    loss and runs every collective of FSDP2's backward."""

    def __init__(self, model: Module) -> None:
        self._kept: list[Any] = []
        self._active = False
        outermost: list[Module] = []
        for module in model.modules():
            if _torch.is_sharded(module, recurse=False) and not any(module in set(o.modules()) for o in outermost):
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
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stand_in_loss(self) -> Tensor | None:
        """A zero whose backward runs every sharded module's backward of the step (None: no output)."""
        leaves = [leaf for output in self._kept for leaf in tree_flatten(output)[0]]
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.requires_grad]
        return torch.stack([tensor.sum() * 0.0 for tensor in tensors]).sum() if tensors else None
