"""What the package needs of a DDP-wrapped model, under the Trainer and under Fabric alike.

- :func:`layout`: the core's view of DDP (or of a model no strategy wrapped), for every front end.
- :func:`single_layout`: one process that trains alone, whatever process group it may have.
- :class:`InReduction`: deferred mode's factor, inside DDP's bucket all-reduce (a communication hook).
- :class:`UnreducedParameters`: DDP reduces the gradients of the parameters that required one when it wrapped the
  model; a parameter unfrozen later (``BaseFinetuning``) trains on each rank's own gradient, so the replicas drift
  apart silently. The check is a host read of ``requires_grad`` per frozen parameter and window, and its problem
  travels in the window's record, so every rank raises before the first such update.
- :class:`ShadowBackward`: ranks out of step, some at a window's end: join that window's gradient all-reduce.
- :func:`stand_in_loss`: a zero that touches every trainable parameter, so that a rank whose ``training_step``
  returned no loss still joins DDP's backward until every rank raises at the window's end.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from token_mean import _torch
from token_mean._comm_hook import scaled_allreduce_hook
from token_mean._core import Layout
from token_mean._deferred import AfterReduction, Deferred, GradientPath
from token_mean._problems import Problem
from token_mean._record import Kind, Reduced, World


def default_world(device: torch.device) -> World:
    """All ranks of the default process group (one process when there is none)."""
    if dist.is_available() and dist.is_initialized():
        return group_world(None, device)
    return World.single(device)


def group_world(group: Any, device: torch.device) -> World:
    """The ranks of ``group`` (None: the default group), which must exist: a group of one is one process."""
    size = dist.get_world_size(group)
    if size == 1:
        return World.single(device)
    return World(size, dist.get_rank(group), device, group=group, distributed=True)


def model_world(model: Module, device: torch.device) -> World:
    """The ranks that share ``model``'s denominator: those of DDP's process group for a DDP-wrapped model, the
    default group's for a model no strategy wrapped (one process without one: FSDP1 and DeepSpeed reduce over it)."""
    if not isinstance(model, DistributedDataParallel):
        return default_world(device)
    # the group DDP reduces the gradients over (`DDPStrategy(process_group=...)` passes one through), not the
    # default group: the counts must add up over the ranks whose gradients add up
    return group_world(model.process_group, device)


def layout(model: Module, device: torch.device) -> Layout:
    """The core's view of ``model`` wrapped in DDP (every rank holds its own batch; the ranks of DDP's process group
    share the denominator), or of a model no strategy wrapped (over :func:`model_world`)."""
    world = model_world(model, device)
    if not isinstance(model, DistributedDataParallel):
        return _unwrapped(model, world)
    return Layout(world, lambda: InReduction(model), [UnreducedParameters(model)], ShadowBackward(model),
                  lambda: _torch.rebuild_ddp_buckets(model),
                  lambda: (model.require_forward_param_sync,))  # what the forward prepared the backward for


def single_layout(model: Module, device: torch.device) -> Layout:
    """One process training ``model`` alone (Fabric's single device): no collective, even where a default process
    group is initialized (several independent processes launched by ``torchrun`` for other reasons): its ranks do
    not share this model's denominator."""
    return _unwrapped(model, World.single(device))


def _unwrapped(model: Module, world: World) -> Layout:
    """A model no strategy wrapped, over ``world``: the factor applied after the backward (``AfterReduction``)."""
    return Layout(world, lambda: AfterReduction(model, world.size))


class InReduction(GradientPath):
    """DDP: the factor rides in DDP's own bucket all-reduce (``PREMUL_SUM`` on NCCL, an in-place scale on gloo)."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self._model = model

    def attach(self, mode: Deferred) -> None:
        # registered on every device type (Lightning registers `ddp_comm_hook` on CUDA only). DDP takes one hook per
        # model, for good: a later deferred mode on the same model (a new accumulator with another K) takes over the
        # installed hook's state instead of registering again.
        state = getattr(self._model, _HOOK_STATE, None)
        if isinstance(state, _HookState):
            state.follow(mode)
            return
        state = _HookState(mode, self._model.process_group)
        try:
            self._model.register_comm_hook(state, scaled_allreduce_hook)
        except RuntimeError as error:
            raise ValueError(
                "`mode='deferred'` folds its factor into DDP's gradient all-reduce with a communication hook, but the"
                f" model already has one ({error}): remove your own `register_comm_hook`, or use `mode='lookahead'`."
            ) from error
        object.__setattr__(self._model, _HOOK_STATE, state)

    def after_backward(self, factor: Callable[[], Tensor]) -> None:
        pass  # the reduction applied it


_HOOK_STATE = "_token_mean_hook_state"


class _HookState:
    """The state of deferred's communication hook: the mode training the model now, held weakly. The reducer (C++)
    holds this state, and the mode leads back to the DDP wrapper: a strong reference would make a cycle through C++
    that ``gc`` never frees, keeping DDP and the process group (its gloo threads) alive into interpreter
    finalization, where a thread that still has to take the GIL aborts the process (``_exit``)."""

    def __init__(self, mode: Deferred, group: Any) -> None:
        self._mode = weakref.ref(mode)
        self.group = group  # DDP's own process group, which DDP holds as long (no cycle)
        self.nccl = dist.get_backend(group) == "nccl"  # asked once, not per bucket

    def follow(self, mode: Deferred) -> None:
        self._mode = weakref.ref(mode)

    def __call__(self) -> Deferred | None:
        return self._mode()


class UnreducedParameters:
    """A window check (``_mode.WindowCheck``): the parameters DDP does not reduce must not train (module docstring)."""

    def __init__(self, model: DistributedDataParallel) -> None:
        ignored = _torch.ddp_ignored(model)
        self._frozen = [
            (name, parameter)
            for name, parameter in model.module.named_parameters()
            if not parameter.requires_grad and name not in ignored
        ]

    def __call__(self) -> list[tuple[Problem, str]]:
        unfrozen = [name for name, parameter in self._frozen if parameter.requires_grad]
        if not unfrozen:
            return []
        more = f" and {len(unfrozen) - 1} more" if len(unfrozen) > 1 else ""
        return [(Problem.UNREDUCED_PARAMETER, f"`{unfrozen[0]}`{more} required no gradient when DDP wrapped the"
                 " model and requires one now")]


class ShadowBackward:
    """What a rank does when it finds the ranks out of step in a blocking collective while others are at a window's
    end: they are about to run their last backward, whose gradient all-reduce would wait for this rank until the
    process group's timeout. This rank joins it with zeros (DDP's own uneven-inputs mechanism), so they reach the
    window's record, which tells them the same thing; then every rank raises the same error."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self._model = model

    def __call__(self, reduced: Reduced) -> None:
        if reduced.kind is not Kind.WINDOW and reduced.ranks_with(Kind.WINDOW)[0] > 0:
            _torch.shadow_ddp_backward(self._model)


def stand_in_loss(module: Module) -> Tensor:
    """A zero touching every trainable parameter, so DDP's reducer fires on this rank too."""
    parameters = [p for p in module.parameters() if p.requires_grad]
    return torch.stack([p.sum() * 0.0 for p in parameters]).sum()


__all__ = [
    "InReduction",
    "ShadowBackward",
    "UnreducedParameters",
    "default_world",
    "group_world",
    "layout",
    "model_world",
    "single_layout",
    "stand_in_loss",
]
