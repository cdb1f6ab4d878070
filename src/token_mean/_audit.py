"""The objective audit: is the gradient the optimizer is about to apply the gradient of the window's objective?

After an audited window's last backward, the audit compares ``g`` (the parameters' ``.grad``) with ``g*``, the
gradient of J = (1 / N) · Σ of the loss over every valid item of the window, all ranks (plus the mean ``aux_loss``
over real micro-batches where the strategy optimizes one). ``g*`` comes from an exact replay of the window's
micro-batches on the unwrapped module, under their recorded RNG states, with detached parameter aliases (no hook or
reducer sees them) and cloned buffers, into one flat buffer per dtype. The error ‖g − g*‖ / ‖g*‖ is the largest over
the ranks; a sharded module is replayed through itself and gives the whole gradient's error (:func:`_sharded_replay`).
Collectives, at audited windows only, over the layout's :class:`~token_mean._layout.World`: an all-reduce of three
floats (N, real micro-batches, a bad count), one of the flat buffers, one of the error (MAX of two floats; sharded: a
SUM of six over every rank, plus the forward and backward collectives of each replayed micro-batch)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from token_mean import _observers, _torch
from token_mean._counts import read_count
from token_mean._layout import World
from token_mean._settings import LossReduction, Settings, Term
from token_mean.errors import AuditError, DenominatorError
from token_mean.results import Audit

OnAuditFailure = Literal["raise", "warn", "log"]

# ‖g − g*‖ / ‖g*‖ of an exact run is rounding: the summation order of the reduction differs from the replay's
PRECISION_ORDER = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""Most precise first: the audit's dtype is the least precise of the parameters and losses (a float64 model with a
float32 loss, as Hugging Face's causal LMs have, rounds like float32)."""
DEFAULT_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
MIXED_TOLERANCE = {"bf16-mixed": 5e-2, "16-mixed": 1e-2}
"""Under autocast the replay's float32 gradient sums bf16/fp16 products in another order than the run's."""

LossFn = Callable[[nn.Module, "Recorded"], Any]
"""(module, micro-batch) → the step's output as the run computed it (:func:`step_losses` takes it apart)."""


RngState = tuple[Tensor, tuple[Tensor, ...]]
"""The global RNG streams a forward draws from (dropout): the CPU generator's state and every initialized CUDA one's."""


def capture_rng() -> RngState:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


def _rng_moved(state: RngState) -> bool:
    cpu, cuda = state
    now_cpu, now_cuda = capture_rng()
    return not torch.equal(cpu, now_cpu) or any(not torch.equal(a, b) for a, b in zip(cuda, now_cuda, strict=False))


def restore_rng(state: RngState) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(list(cuda))


@dataclass(frozen=True)
class Recorded:
    """A micro-batch of an audited window as its forward saw it (a ``filler`` adds no item and no ``aux_loss``;
    ``index``: Lightning's ``batch_idx``)."""

    batch: Any
    rng: RngState
    filler: bool = False
    index: int = 0
    trained: Any = None  # the step's losses as it trained (detached): the count check tells randomness by them


class Replayed(NamedTuple):
    """What an audit's replay gives."""

    error: float | None  # ‖g − g*‖ / ‖g*‖ (None when N = 0 on every rank)
    dtype: torch.dtype  # the least precise dtype of parameters and losses


@dataclass(frozen=True)
class Objective:
    """What the audit recomputes: the step's output for one micro-batch (a loss, or a mapping with ``"loss"``,
    ``"aux_loss"``, ``"num_items"`` or the terms' losses), its count and how the loss relates to the count."""

    loss_fn: LossFn
    count_fn: Callable[[Any], Any]
    loss_reduction: LossReduction  # "mean": a micro-batch's loss is the mean over its count; "sum": the sum
    with_aux: bool = False  # add the mean of 'aux_loss' over the window's real micro-batches (the strategy's)
    context: Callable[[], AbstractContextManager[Any]] = nullcontext  # the forward's precision context
    terms: tuple[Any, ...] = ()  # an objective of several terms: (name, count, reduction) each; the loss a mapping
    num_items: bool = False  # a reported 'num_items' is the count (deferred mode): the count check takes it
    check_count: bool = True  # False: the strategy's `check_count=False`, so no count check at audited windows


def step_losses(output: Any, terms: bool) -> tuple[Any, Tensor | None]:
    """A step's output as the audit weighs it, (loss, aux), the loss None where there is none; with ``terms`` the
    loss is the mapping of the terms' losses (its ``"loss"``, if any, is not the objective's)."""
    if isinstance(output, Tensor):
        return (None if terms else output), None
    if not isinstance(output, Mapping):
        return None, None
    aux = output.get("aux_loss")
    loss = output if terms else output.get("loss")
    return (loss if terms or isinstance(loss, Tensor) else None), (aux if isinstance(aux, Tensor) else None)


def trained_losses(output: Any, names: Sequence[str]) -> Any:
    """What the count check compares a replay with: the step's loss (several terms: the mapping of their losses),
    detached; nothing else the step returned is kept."""
    if isinstance(output, Tensor):
        return output.detach()
    if not isinstance(output, Mapping):
        return None
    if names:
        return {name: value.detach() for name in names if isinstance(value := output.get(name), Tensor)}
    loss = output.get("loss")
    return {"loss": loss.detach()} if isinstance(loss, Tensor) else None


def refusal(module: nn.Module, mesh: Any = None) -> str | None:
    """Why the replay cannot audit ``module`` exactly, or None; ``mesh``: the run's device mesh, if it has one."""
    if _torch.is_sharded(module) and "data_parallel" not in (getattr(mesh, "mesh_dim_names", None) or ()):
        return (
            "its parameters are sharded (FSDP2 or tensor parallelism) and the run has no device mesh with a"
            " 'data_parallel' dimension to say which ranks' items add up: run it under `ModelParallelStrategy`"
        )
    if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        return (
            "it has a `SyncBatchNorm`: its forward is a collective, and the replay skips micro-batches without"
            " items, which differ between ranks"
        )
    return None


def objective_error(
    module: nn.Module, micro_batches: Sequence[Recorded], objective: Objective, world: World
) -> Replayed:
    """The error and audit dtype (:data:`Replayed`) of the window of this rank's ``micro_batches``, counts and
    gradients added over ``world``. Every rank of ``world`` (sharded: of the default group) must call it. Leaves
    ``.grad``, the buffers and the RNG streams as they were.

    Raises:
        AuditError: a micro-batch of the window could not be counted, on any rank.
    """
    # every trainable parameter, once (tied ones too)
    parameters = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    device, group, distributed = world.device, world.group, world.distributed
    terms = objective.terms or (Term("", objective.count_fn, objective.loss_reduction),)
    read = [
        [(0.0, None, "") if mb.filler else read_count(term.count_fn, mb.batch) for term in terms]
        for mb in micro_batches
    ]
    counts = [tuple(count for count, _, _ in row) for row in read]
    problems = [f"{problem.what} ({detail})" for row in read for _, problem, detail in row if problem is not None]
    real = float(sum(not mb.filler for mb in micro_batches))
    # a bad count travels with the totals, so every rank raises and none waits in the next collective
    sums = [math.fsum(row[t] for row in counts) for t in range(len(terms))]
    totals = torch.tensor([*sums, real, float(bool(problems))], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(totals, group=group)
    *global_counts, global_real, bad = totals.tolist()
    if bad:
        where = problems[0] if problems else "on another rank"
        raise AuditError(f"The objective audit could not count a micro-batch of its window: {where}.")
    dtypes = [p.dtype for _, p in parameters]  # with those the replay weighs in (and those the sharded forward uses)
    if not any(global_counts):
        return Replayed(None, least_precise(dtypes))
    window = list(zip(micro_batches, counts, strict=True))
    sharded = _torch.is_sharded(module)
    parameters, used = _held_and_used(module, parameters) if sharded else (parameters, [p for _, p in parameters])
    buffers, expected = _flat_buffers(parameters, used)  # the views see the all-reduce below: they share storage
    step = _stepper(module, objective, terms, global_counts, global_real, dtypes)
    after = capture_rng()
    try:
        with _torch.metrics_kept(module):
            if sharded:
                dtypes += [leaf.dtype for leaf in used]
                _sharded_replay(module, used, expected, window, step)
            else:
                _replay(module, parameters, expected, window, objective, step)
    finally:
        restore_rng(after)
    if distributed:
        for flat in buffers.values():
            dist.all_reduce(flat, group=group)
    if sharded:  # its shards lie on every rank of the mesh, the tensor-parallel ones too: the default group's
        return _sharded_error(parameters, used, expected, dtypes, device, dist.is_initialized())
    order = float(PRECISION_ORDER.index(least_precise(dtypes)))
    relative = _relative_error(parameters, expected, device)
    error = torch.stack([relative, torch.tensor(order, dtype=torch.float64, device=device)])
    if distributed:
        dist.all_reduce(error, op=dist.ReduceOp.MAX, group=group)
    figure, agreed = error.tolist()
    return Replayed(figure, PRECISION_ORDER[int(agreed)])


def least_precise(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    known = [PRECISION_ORDER.index(d) for d in dtypes if d in PRECISION_ORDER]
    return PRECISION_ORDER[max(known, default=1)]


_Key = tuple[torch.dtype, torch.device]


def _flat_buffers(
    parameters: Sequence[tuple[str, nn.Parameter]], used: Sequence[Tensor]
) -> tuple[dict[_Key, Tensor], list[Tensor]]:
    """One zeroed flat buffer per dtype and device, and each parameter's replayed gradient as its part of one: the
    parameter's dtype, shaped like the local part of the tensor its forward uses."""
    sizes: dict[_Key, int] = {}
    spans = []
    for (_, p), leaf in zip(parameters, used, strict=True):
        key, shape = (p.dtype, leaf.device), _local(leaf).shape
        start = sizes.get(key, 0)
        sizes[key] = start + shape.numel()
        spans.append((key, start, shape))
    buffers = {key: torch.zeros(size, dtype=key[0], device=key[1]) for key, size in sizes.items()}
    return buffers, [buffers[key][start : start + shape.numel()].view(shape) for key, start, shape in spans]


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Replay(nn.Module):
    """Makes the run's loss a ``forward``, for ``functional_call``."""

    def __init__(self, module: nn.Module, loss_fn: Callable[[nn.Module, Recorded], Any]) -> None:
        super().__init__()
        self.module = module
        self._loss_fn = loss_fn

    def forward(self, micro_batch: Recorded) -> Any:
        return self._loss_fn(self.module, micro_batch)


def forward_only(
    module: nn.Module,
    fn: Callable[[nn.Module, Recorded], Any],
    micro_batch: Recorded,
    context: Callable[[], AbstractContextManager[Any]],
    drew: list[bool],
) -> Any:
    """``fn(module, micro_batch)`` without gradient, under the micro-batch's recorded RNG state, on cloned buffers:
    parameters, buffers, RNG streams and ``.grad`` stay as they were (FSDP2 keeps a root it unsharded for a forward
    without gradient so until it is told to reshard: told here, or the next forward would use stale parameters).
    ``drew``: gets whether the forward drew from the global generators (dropout)."""
    from torch.distributed.fsdp import FSDPModule

    after = capture_rng()
    restore_rng(micro_batch.rng)
    try:
        with torch.no_grad(), context():
            return torch.func.functional_call(_Replay(module, fn), _buffer_clones(module), (micro_batch,))
    finally:
        drew.append(_rng_moved(micro_batch.rng))
        restore_rng(after)
        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                submodule.reshard()


def count_check(
    module: nn.Module, recorded: Sequence[Recorded], objective: Objective, where: str, world: World, step: str
) -> tuple[float | None, str | None, list[str]]:
    """The count check (:mod:`token_mean._count_check`) of a window's ``recorded`` micro-batches, on every rank of
    ``world`` (the ranks that share N; tensor-parallel peers check the same batches): the largest relative mismatch
    (None: nothing decided), the error every rank raises (None: passed) and the warnings every rank gives (the
    check could not decide). ``objective.loss_fn`` gives the step's output; ``step`` names it in messages."""
    from token_mean._count_check import Replays, Sample, Term, check, decide, forwards_per_sample

    terms = objective.terms or (Term(None, objective.count_fn, objective.loss_reduction),)
    samples = [Sample(mb.batch, mb.filler, mb.trained) for mb in recorded]

    def replay(batch: Any, index: int) -> Any:
        drew: list[bool] = []
        try:
            return forward_only(
                module, objective.loss_fn, replace(recorded[index], batch=batch), objective.context, drew
            )
        finally:
            if any(drew):
                replays.drew.add(index)

    replays = Replays(replay, samples, matched=_torch.is_sharded(module))
    batch_statistics = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules())
    with _torch.metrics_kept(module):
        local = [check(replays, term, objective.num_items, batch_statistics, terms) for term in terms]
        replays.pad(len(samples) * forwards_per_sample(terms))  # the forwards are collectives: as many on each rank
    gathered = [local]
    if world.distributed:
        gathered = [None] * world.size  # type: ignore[list-item]
        dist.all_gather_object(gathered, local, group=world.group)
    return decide(gathered, terms, where, step)


class FirstWindowCheck:
    """The count check of a fit's (an accumulator's) first window, as a first-window observer
    (:mod:`token_mean._observers`): its micro-batches as their forwards start, the losses they trained on, then the
    check on every rank before the window's update (``docs/counts.md``)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._recorded: list[Recorded] = []

    @classmethod
    def of(cls, settings: Settings, replayable: bool) -> FirstWindowCheck | None:
        """The check, or None with ``check_count=False``; where no loss can be replayed, None and a warning."""
        if not settings.check_count:
            return None
        if not replayable:
            rank_zero_warn(
                "token_mean: `TokenMeanAccumulator` cannot check the count: it replays the loss at the first window,"
                " and was given no `loss_fn`. Pass `loss_fn=fn(model, batch) -> loss`, the loss the loop passes to"
                " `accumulator.backward` (docs/counts.md), or `check_count=False` to silence this."
            )
            return None
        return cls(settings)

    def micro_batch(self, batch: Any, filler: bool, index: int) -> None:
        self._recorded.append(Recorded(batch, capture_rng(), filler, index))

    def trained(self, output: Any) -> None:
        names = [term.name for term in self._settings.terms]
        if self._recorded:
            self._recorded[-1] = replace(self._recorded[-1], trained=trained_losses(output, names))

    def ended(self, replay: _observers.Replay, where: str) -> None:
        settings = self._settings
        deferred = settings.mode == "deferred"  # a reported 'num_items' is the count

        def loss_fn(module: nn.Module, micro_batch: Recorded) -> Any:
            return replay.loss_fn(module, micro_batch.batch, micro_batch.index)

        objective = Objective(
            loss_fn, settings.count_fn, settings.loss_reduction, False, replay.context, settings.terms, deferred
        )
        _, error, warnings = count_check(replay.module, self._recorded, objective, where, replay.world, replay.step)
        if error is not None:
            raise DenominatorError(error)
        for warning in warnings:
            rank_zero_warn(warning)


_observers.FIRST_WINDOW.append(FirstWindowCheck.of)


Step = Callable[[dict[str, Tensor], "Recorded", "tuple[float, ...]"], "tuple[Any, Tensor | None]"]
"""(the module's state, a micro-batch, its count per term) → its replayed (loss, aux) and what it adds to J."""


def _stepper(
    module: nn.Module,
    objective: Objective,
    terms: Sequence[Term],
    global_counts: Sequence[float],
    global_real: float,
    dtypes: list[torch.dtype],
) -> Step:
    """One micro-batch's replay, the forward with ``state`` under its recorded RNG state, and what it adds to J:
    Σ_t w_t · loss_t (+ aux_m / M, the window's real micro-batches); one term: the loss itself, several: the
    replayed mapping's term losses. The dtypes of the losses are appended to ``dtypes``."""
    replay = _Replay(module, objective.loss_fn)

    def step(state: dict[str, Tensor], micro_batch: Recorded, counts: tuple[float, ...]) -> tuple[Any, Tensor | None]:
        restore_rng(micro_batch.rng)
        with objective.context():
            loss, aux = step_losses(torch.func.functional_call(replay, state, (micro_batch,)), bool(objective.terms))
        total = None
        for term, count, global_count in zip(terms, counts, global_counts, strict=True):
            value = (loss.get(term.name) if isinstance(loss, Mapping) else None) if objective.terms else loss
            if not isinstance(value, Tensor):
                continue
            dtypes.append(value.dtype)
            if count != 0:
                part = value * ((count if term.reduction == "mean" else 1.0) / global_count)
                total = part if total is None else total + part
        if aux is not None:
            dtypes.append(aux.dtype)
            if objective.with_aux and not micro_batch.filler:
                total = aux / global_real if total is None else total + aux / global_real
        return (loss, aux), total

    return step


def _replay(
    module: nn.Module,
    parameters: Sequence[tuple[str, nn.Parameter]],
    views: Sequence[Tensor],
    window: Sequence[tuple[Recorded, tuple[float, ...]]],
    objective: Objective,
    step: Step,
) -> None:
    """This rank's share of g*, Σ_m ∂(w_m · loss_m + aux_m / M)/∂θ, for plain parameters, into ``views``."""
    leaves = {}
    for (name, p), view in zip(parameters, views, strict=True):
        leaf = p.detach().requires_grad_(True)  # shares the storage; a new autograd leaf without hooks
        leaf.grad = view  # backward accumulates in place into the flat buffer
        leaves[f"module.{name}"] = leaf
    state = {**leaves, **_buffer_clones(module)}
    for micro_batch, count in window:
        if not any(count) and not (objective.with_aux and not micro_batch.filler):
            continue  # no item: no gradient (its mean loss is 0/0)
        _, total = step(state, micro_batch, count)
        if total is not None and total.requires_grad:
            total.backward()  # type: ignore[no-untyped-call]


def _buffer_clones(module: nn.Module) -> dict[str, Tensor]:
    """The module's buffers, cloned so that the replay leaves BatchNorm statistics as they were."""
    return {f"module.{name}": b.clone() for name, b in module.named_buffers()}


def _held_and_used(
    module: nn.Module, parameters: Sequence[tuple[str, nn.Parameter]]
) -> tuple[list[tuple[str, nn.Parameter]], list[Tensor]]:
    """Each parameter as the optimizer holds it (whose ``.grad`` is compared) and the tensor its forward uses
    (FSDP2's unsharded parameter; a parameter FSDP2 does not manage is both)."""
    pairs: dict[int, tuple[nn.Parameter, Tensor]] = {}
    for sharded, unsharded in _torch.fsdp_parameter_pairs(module):
        pairs[id(sharded)] = pairs[id(unsharded)] = (sharded, unsharded)  # between forwards either may be registered
    held = [(name, pairs.get(id(p), (p, p))[0]) for name, p in parameters]
    used = [pairs.get(id(p), (p, p))[1] for _, p in parameters]
    return held, used


def _sharded_replay(
    module: nn.Module, used: Sequence[Tensor], views: Sequence[Tensor], window: Sequence[Any], step: Step
) -> None:
    """This rank's share of g* for a module FSDP2 shards or tensor parallelism splits, into ``views``, shaped like
    the local parts of the ``used`` tensors. Every micro-batch runs forward and backward through the module on every
    rank, so the collectives match; one that adds nothing back-propagates its own loss (or a zero of the sharded
    outputs) with the sink closed. ``autograd.grad`` with respect to the used tensors writes no ``.grad``: FSDP2
    reduce-scatters nothing and hooks on its sharded parameters never fire (those on unmanaged parameters do)."""
    from token_mean._layout import Outputs

    sink = [True]  # open: the hooks add into the flat buffers
    handles = [
        leaf.register_hook(_sink(leaf, view, sink))  # type: ignore[no-untyped-call]
        for leaf, view in zip(used, views, strict=True)
    ]
    outputs = Outputs(module)
    state = _buffer_clones(module)
    try:
        with torch.enable_grad():
            for micro_batch, count in window:
                with outputs.kept():
                    replayed, total = step(state, micro_batch, count)
                sink[0] = total is not None and total.requires_grad
                if not sink[0]:
                    loss, aux = replayed  # a tensor that reaches the sharded modules, whatever it weighs
                    losses = [*(loss.values() if isinstance(loss, Mapping) else [loss]), aux]
                    total = next((t for t in losses if isinstance(t, Tensor) and t.requires_grad), None)
                if total is None:
                    total = outputs.stand_in_loss()  # None: no sharded module ran, no collective to match
                if total is not None:
                    torch.autograd.grad(total, used, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
        outputs.remove()


def _sink(leaf: Tensor, view: Tensor, open_: list[bool]) -> Callable[[Tensor], Tensor]:
    """A tensor hook that adds the used tensor's gradient (made whole) into its flat-buffer slice while ``open_[0]``,
    and hands autograd an expanded 0-dim zero: the flat buffer is the only gradient's worth of memory the replay
    holds."""
    from torch.distributed.tensor import DTensor

    def add(gradient: Tensor) -> Tensor:
        if isinstance(gradient, DTensor) and isinstance(leaf, DTensor):
            if gradient.placements != leaf.placements:  # a tensor-parallel partial sum: FSDP2 does this too
                gradient = gradient.redistribute(gradient.device_mesh, leaf.placements)  # open or not: a collective
            local = gradient.to_local()
            if open_[0]:
                view.add_(local)
            nothing = torch.zeros((), dtype=local.dtype, device=local.device).expand(local.shape)
            return DTensor.from_local(
                nothing,
                gradient.device_mesh,
                gradient.placements,
                run_check=False,
                shape=gradient.shape,
                stride=gradient.stride(),
            )
        if open_[0]:
            view.add_(gradient)
        return torch.zeros((), dtype=gradient.dtype, device=gradient.device).expand(gradient.shape)

    return add


def _sharded_error(
    parameters: Sequence[tuple[str, nn.Parameter]],
    used: Sequence[Tensor],
    expected: Sequence[Tensor],
    dtypes: list[torch.dtype],
    device: torch.device,
    distributed: bool,
) -> Replayed:
    """‖g − g*‖ / ‖g*‖ over the whole gradient, each rank comparing the part its ``.grad`` holds (a part several ranks
    hold counts once), with one SUM all-reduce over the default group."""
    ranks = dist.get_world_size() if distributed else 1
    held = (_held_part(p, leaf, whole, ranks) for (_, p), leaf, whole in zip(parameters, used, expected, strict=True))
    difference, reference = _squared_sums(held, device)
    order = PRECISION_ORDER.index(least_precise(dtypes))
    dtype_rank = torch.eye(len(PRECISION_ORDER), dtype=torch.float64, device=device)[order]
    sums = torch.cat([torch.stack([difference, reference]), dtype_rank])
    if distributed:
        dist.all_reduce(sums)
    difference_sum, reference_sum, *dtype_ranks = sums.tolist()
    agreed = max(index for index, count in enumerate(dtype_ranks) if count > 0)
    error = math.sqrt(difference_sum / reference_sum) if reference_sum > 0 else math.inf
    return Replayed(0.0 if difference_sum == 0 else error, PRECISION_ORDER[agreed])


def _held_part(parameter: nn.Parameter, leaf: Tensor, whole: Tensor, ranks: int) -> tuple[Tensor | None, Tensor, int]:
    """This rank's local ``.grad`` of ``parameter`` (None if unset), the same part of ``whole`` (the summed gradient
    of ``leaf``), and how many ranks hold that part."""
    from torch.distributed.tensor import DTensor, Replicate

    grad = parameter.grad
    if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
        grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements])
    layout = grad if isinstance(grad, DTensor) else parameter
    if not isinstance(layout, DTensor):
        return grad, whole, ranks
    mesh = layout.device_mesh
    # FSDP2 lays a sharded parameter out as (data-parallel dims, *tensor-parallel dims); `whole` is replicated over
    # the former and placed like the tensor-parallel `leaf` over the latter
    inner = list(leaf.placements) if isinstance(leaf, DTensor) else []
    placements = [Replicate()] * (mesh.ndim - len(inner)) + inner
    with torch.no_grad():
        spread = DTensor.from_local(
            whole, mesh, placements, run_check=False, shape=layout.shape, stride=layout.stride()
        )
        part = spread.redistribute(mesh, layout.placements).to_local()  # from replicated: a slice, no collective
    pieces = math.prod(
        mesh.size(dim) for dim, placement in enumerate(layout.placements) if not placement.is_replicate()
    )
    return None if grad is None else _local(grad), part, ranks // pieces


def _relative_error(
    parameters: Sequence[tuple[str, nn.Parameter]], objective: Sequence[Tensor], device: torch.device
) -> Tensor:
    """‖g − g*‖ / ‖g*‖ on the device, in float64 (0 when both are zero, inf when g* is zero and g is not)."""
    difference, reference = _squared_sums(
        [(p.grad, g, 1) for (_, p), g in zip(parameters, objective, strict=True)], device
    )
    ratio = (difference / reference).sqrt()
    return torch.where(difference == 0, torch.zeros_like(ratio), ratio)


def _squared_sums(compared: Iterable[tuple[Tensor | None, Tensor, int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Σ ‖g − g*‖² and Σ ‖g*‖² on the device, in float64, over (``.grad`` or None, g*, the ranks holding that part)."""
    difference = torch.zeros((), dtype=torch.float64, device=device)
    reference = torch.zeros((), dtype=torch.float64, device=device)
    for applied, expected, holders in compared:
        expected64 = expected.to(device, torch.float64)
        applied64 = torch.zeros_like(expected64) if applied is None else applied.detach().to(device, torch.float64)
        squares, norm = (applied64 - expected64).square().sum(), expected64.square().sum()
        if holders > 1:  # a part several ranks hold counts once
            squares, norm = squares / holders, norm / holders
        difference += squares
        reference += norm
    return difference, reference


class Auditor:
    """One run's audits, for a monitor: it records an audited window's micro-batches as their forwards start and
    audits the window's update once (whatever the optimizers), before anything changes its gradient.

    Args:
        every: audit the first window and every ``every``-th after it (None: no audit).
        on_failure: ``"raise"``, ``"warn"`` or ``"log"``.
        tolerance: the largest error that passes (None: a default by dtype).
        front_end: the monitor's name, for messages.
    """

    def __init__(self, every: object, on_failure: object, tolerance: object, front_end: str) -> None:
        from token_mean._settings import positive_int

        self.every = positive_int(every, "audit_every", "audit the first window and every N-th after it", "no audit")
        if on_failure not in ("raise", "warn", "log"):
            raise ValueError(f"`on_audit_failure` must be 'raise', 'warn' or 'log', got {on_failure!r}.")
        if tolerance is not None and (
            isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0
        ):
            raise ValueError(
                f"`audit_tolerance` must be a number >= 0 or None (a default by dtype), got {tolerance!r}."
            )
        self.on_failure: OnAuditFailure = on_failure  # type: ignore[assignment]
        self.tolerance: float | None = None if tolerance is None else float(tolerance)
        self._front_end = front_end
        self._step = "`audit_loss`" if front_end == "FabricMonitor" else "`training_step`"  # what replays the loss
        self.audits: list[Audit] = []
        self._first: int | None = None  # the run's first window, audited, then every `every`-th
        self._objective: Objective | None = None
        self._precision: str | None = None
        self._world = World.single()  # the ranks that share the denominator, from `prepare`
        self._recorded: list[Recorded] | None = None  # the audited window's micro-batches, until its update
        self._done = False  # the window's audit ran
        self._skipped_tolerance = 0.0  # what a window with nothing to compare reports

    def tolerance_for(self, dtype: torch.dtype) -> float:
        """``audit_tolerance``, else the default for the run's mixed precision or for ``dtype``."""
        if self.tolerance is not None:
            return self.tolerance
        if self._precision in MIXED_TOLERANCE:
            return MIXED_TOLERANCE[self._precision]
        return DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE[torch.float32])

    def _due(self, window: int) -> bool:
        if self.every is None or self._first is None:
            return False
        return window >= self._first and (window - self._first) % self.every == 0

    @property
    def enabled(self) -> bool:
        return self.every is not None

    def prepare(
        self,
        module: nn.Module,
        objective: Objective | None,
        world: World,
        precision: str | None = None,
        mesh: Any = None,
    ) -> None:
        """What the audit recomputes, for ``module``; a ``ValueError`` if the replay cannot audit it. ``world``: the
        ranks that share the denominator; ``mesh``: the run's device mesh (default ``module.device_mesh``)."""
        if self.every is None or objective is None:
            return
        if mesh is None:
            mesh = getattr(module, "device_mesh", None)
        why = refusal(module, mesh)
        if why is not None:
            raise ValueError(
                f"`{self._front_end}(audit_every={self.every})` cannot audit this model: {why}. Remove"
                ' `audit_every` (docs/audit.md, "Limits").'
            )
        self._objective, self._precision, self._world = objective, precision, world
        dtype = least_precise([p.dtype for p in module.parameters()])
        self._skipped_tolerance = self.tolerance_for(dtype)

    def start(self, first_window: int) -> None:
        """A run starts at window ``first_window`` (the optimizer steps taken before it)."""
        self.audits.clear()  # in place: a monitor hands this list out
        self._recorded = None
        self._first = first_window

    def micro_batch(self, window: int, first: bool, batch: Any, filler: bool = False, index: int = 0) -> None:
        """A micro-batch's forward is about to run (``first``: its window's first)."""
        if first:
            self._recorded = [] if self._objective is not None and self._due(window) else None
            self._done = False
        if self._recorded is not None:
            self._recorded.append(Recorded(batch, capture_rng(), filler, index))

    def filler(self) -> None:
        """The micro-batch recorded last is a zero-weight filler."""
        if self._recorded:
            self._recorded[-1] = replace(self._recorded[-1], filler=True)

    def audit(self, module: nn.Module, window: int, unseen: Callable[[], str]) -> Audit | None:
        """After the window's last backward, on every rank of the world: its audit (None if not audited). A failure
        raises, warns or logs as ``on_failure`` says, naming ``unseen()``."""
        if self._recorded is None or self._done or self._objective is None:
            return None
        self._done = True
        error, dtype = objective_error(module, self._recorded, self._objective, self._world)
        tolerance = self.tolerance_for(dtype)
        objective = self._objective
        count_error, count_failure, warnings = (
            count_check(module, self._recorded, objective, f"optimizer step {window}", self._world, self._step)
            if objective.check_count
            else (None, None, [])
        )
        for warning in warnings:
            rank_zero_warn(warning)
        passed = (error is None or error <= tolerance) and count_failure is None
        audit = Audit(window, error, tolerance, passed, count_error)
        self.audits.append(audit)
        if not audit.passed:
            message = failure_message(audit, unseen()) if count_failure is None else count_failure
            if self.on_failure == "raise":
                raise AuditError(message)  # the error is the same on every rank: every rank raises
            (rank_zero_warn if self.on_failure == "warn" else rank_zero_info)(message)
        return audit

    def window_end(self, window: int) -> Audit | None:
        """The window ended: its audit, if due (a skipped update, N = 0, passes with nothing to compare)."""
        recorded, self._recorded = self._recorded, None
        if recorded is None:
            return None
        if not self._done:
            self.audits.append(Audit(window, None, self._skipped_tolerance, True))
        return self.audits[-1]


def failure_message(audit: Audit, unseen: str) -> str:
    """What a failed audit says: the step, the error, the tolerance, and ``unseen``, what the audit cannot see."""
    return (
        f"The objective audit failed at optimizer step {audit.step}: the gradient the optimizer is about to"
        f" apply differs from the gradient of the window's token-mean objective by ‖g − g*‖/‖g*‖ = {audit.error:.3e}"
        f" (tolerance {audit.tolerance:.1e}). g* was recomputed by replaying the window's micro-batches on the"
        f" unwrapped module, so the difference comes from what lies between the loss and the optimizer, which the"
        f" audit cannot see: {unseen}. Fix the normalization (e.g. use a token-mean strategy), or raise"
        " `audit_tolerance` if this precision is expected."
    )
