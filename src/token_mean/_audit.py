"""The objective audit: is the gradient the optimizer is about to apply the gradient of the window's objective?

At an audited window, after its last backward and before anything changes the gradient for the update, the audit
compares ``g``, the parameters' ``.grad``, with ``g*``, the gradient of the objective itself,

    J = (1 / N) · Σ over every valid item of the window (all ranks, all micro-batches) of its loss

(plus the mean of ``aux_loss`` over the window's real micro-batches where the strategy optimizes one), N and the
counts as ``count_fn`` defines them. ``g*`` is recomputed from the window's own micro-batches by an exact replay
(:func:`objective_error`): each micro-batch's forward runs again on the unwrapped module, under the RNG state its
forward saw, through ``torch.func.functional_call`` with detached aliases of the parameters (fresh autograd leaves:
no gradient hook, no DDP reducer, no comm hook sees them; no copy of the weights) and clones of the buffers (BatchNorm
statistics stay as they were). The backward of each weighted loss accumulates into one flat buffer per dtype, on the
parameters' device: one extra gradient's worth. The error ‖g − g*‖ / ‖g*‖ is taken on every rank and the largest
is the window's (a gradient that differs between replicas is wrong on some rank).

Collectives, at an audited window only: one all-reduce of two floats (N and the real micro-batches), one of the
flat buffer (per dtype) and one MAX of the error. Nothing runs at a window that is not audited.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from token_mean._counting import CountFn, read_count
from token_mean._problems import DenominatorError

OnAuditFailure = Literal["raise", "warn", "log"]

# ‖g − g*‖ / ‖g*‖ of an exact run is rounding: the summation order of the reduction differs from the replay's
PRECISION_ORDER = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""From the most precise to the least: the audit's dtype is the least precise of the parameters and the losses (a
float64 model whose loss is taken in float32, as Hugging Face's causal LMs do, rounds like float32)."""
DEFAULT_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
MIXED_TOLERANCE = {"bf16-mixed": 5e-2, "16-mixed": 1e-2}
"""Under autocast the replay's float32 gradient sums bf16/fp16 products in another order than the run's."""

LossFn = Callable[[nn.Module, "MicroBatch"], "tuple[Tensor | None, Tensor | None]"]
"""(module, micro-batch) → (its loss as the run computed it, its ``aux_loss`` or None); None: no gradient."""


class AuditError(DenominatorError):
    """The gradient the optimizer was about to apply is not the gradient of the window's objective (the audit)."""


@dataclass(frozen=True)
class Audit:
    """One audited window.

    Attributes:
        step: the optimizer step (as ``trainer.global_step`` before the update).
        error: ‖g − g*‖ / ‖g*‖, the largest over the ranks; ``None`` when the window had no valid item on any rank
            (N = 0: no objective, nothing to compare).
        tolerance: the largest error that passes.
        passed: ``error <= tolerance`` (True when there was nothing to compare).
    """

    step: int
    error: float | None
    tolerance: float
    passed: bool


@dataclass(frozen=True)
class RngState:
    """The global RNG streams a forward draws from (dropout): the CPU generator and every initialized CUDA one."""

    cpu: Tensor
    cuda: tuple[Tensor, ...]

    @staticmethod
    def capture() -> RngState:
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()  # type: ignore[no-untyped-call]
        return RngState(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(list(self.cuda))


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch of an audited window as its forward saw it: the batch, the RNG state, whether it was a
    zero-weight filler (it adds no item and no ``aux_loss``), and its position (Lightning's ``batch_idx``)."""

    batch: Any
    rng: RngState
    filler: bool = False
    index: int = 0


@dataclass(frozen=True)
class Replayed:
    """What the replay found: ``error`` (None when N = 0 on every rank) and ``dtype``, the least precise dtype of
    the parameters and the replayed losses on any rank (what the default tolerance depends on)."""

    error: float | None
    dtype: torch.dtype


@dataclass(frozen=True)
class Objective:
    """What the audit recomputes: the loss of one micro-batch, its count and how the loss relates to the count."""

    loss_fn: LossFn
    count_fn: CountFn
    loss_reduction: str  # "mean": a micro-batch's loss is the mean over its count; "sum": the sum
    with_aux: bool = False  # add the mean of 'aux_loss' over the window's real micro-batches (the strategy's)
    context: Callable[[], AbstractContextManager[Any]] = nullcontext  # the forward's precision context


class AuditSchedule:
    """The audit's settings, checked once: which windows it audits and what it does with a failure."""

    def __init__(self, every: object, on_failure: object, tolerance: object) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"`audit_every` must be a positive int (audit the first window and every N-th after it) or None (no"
                f" audit), got {every!r}."
            )
        if on_failure not in ("raise", "warn", "log"):
            raise ValueError(f"`on_audit_failure` must be 'raise', 'warn' or 'log', got {on_failure!r}.")
        if tolerance is not None and (
            isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0
        ):
            raise ValueError(
                f"`audit_tolerance` must be a number >= 0 or None (a default by dtype), got {tolerance!r}."
            )
        self.every: int | None = every  # type: ignore[assignment]
        self.on_failure: OnAuditFailure = on_failure  # type: ignore[assignment]
        self.tolerance: float | None = None if tolerance is None else float(tolerance)
        self._first: int | None = None

    @property
    def enabled(self) -> bool:
        return self.every is not None

    def start(self, first_window: int) -> None:
        """A run starts: its first window (by index) is audited, then every ``every``-th."""
        self._first = first_window

    def due(self, window: int) -> bool:
        if self.every is None or self._first is None:
            return False
        return window >= self._first and (window - self._first) % self.every == 0

    def tolerance_for(self, dtype: torch.dtype, precision: str | None = None) -> float:
        """``audit_tolerance``, else the default for the least precise dtype of the parameters and the losses
        (``dtype``) or for a mixed ``precision``."""
        if self.tolerance is not None:
            return self.tolerance
        if precision in MIXED_TOLERANCE:
            return MIXED_TOLERANCE[precision]
        return DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE[torch.float32])


def audited_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters whose gradient is compared: every trainable parameter of the module, once (tied ones too)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def refusal(module: nn.Module) -> str | None:
    """Why the replay cannot audit ``module`` exactly, or None."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        return (
            "its parameters are DTensors (FSDP2 or tensor parallelism): the replay runs the unwrapped module on"
            " whole parameters, which a sharded module does not hold"
        )
    if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        return (
            "it has a `SyncBatchNorm`: its forward is a collective, and the replay skips micro-batches without"
            " items, which differ between ranks"
        )
    return None


def objective_error(
    module: nn.Module,
    micro_batches: Sequence[MicroBatch],
    objective: Objective,
    group: Any = None,
    device: torch.device | None = None,
) -> Replayed:
    """‖g − g*‖ / ‖g*‖ for the window of ``micro_batches`` (this rank's), the largest over the ranks of ``group``
    (the default group when distributed); None when N = 0 on every rank. Leaves ``.grad``, the buffers and the RNG
    streams as they were. Every rank of the group must call it for the same window."""
    parameters = audited_parameters(module)
    if device is None:
        device = parameters[0][1].device if parameters else torch.device("cpu")
    distributed = dist.is_available() and dist.is_initialized()
    read = [(0.0, None, "") if mb.filler else read_count(objective.count_fn, mb.batch) for mb in micro_batches]
    counts = [count for count, _, _ in read]
    problems = [f"{problem.what} ({detail})" for _, problem, detail in read if problem is not None]
    real = float(sum(not mb.filler for mb in micro_batches))
    # a bad count travels with the totals, so every rank raises and none waits in the next collective
    totals = torch.tensor([math.fsum(counts), real, float(bool(problems))], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(totals, group=group)
    global_count, global_real, bad = totals.tolist()
    if bad:
        where = problems[0] if problems else "on another rank"
        raise AuditError(f"The objective audit could not count a micro-batch of its window: {where}.")
    dtypes = [p.dtype for _, p in parameters]
    if global_count == 0:
        return Replayed(None, least_precise(dtypes))
    after = RngState.capture()
    try:
        buffers = _replay(module, parameters, micro_batches, counts, objective, (global_count, global_real), dtypes)
    finally:
        after.restore()
    if distributed:
        for flat in buffers.values():
            dist.all_reduce(flat, group=group)
    order = float(PRECISION_ORDER.index(least_precise(dtypes)))
    relative = _relative_error(parameters, _views(parameters, buffers), device)
    error = torch.stack([relative, torch.tensor(order, dtype=torch.float64, device=device)])
    if distributed:
        dist.all_reduce(error, op=dist.ReduceOp.MAX, group=group)
    figure, agreed = error.tolist()
    return Replayed(figure, PRECISION_ORDER[int(agreed)])


def least_precise(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    known = [PRECISION_ORDER.index(d) for d in dtypes if d in PRECISION_ORDER]
    return PRECISION_ORDER[max(known, default=1)]


_Key = tuple[torch.dtype, torch.device]


def _flat_buffers(parameters: Sequence[tuple[str, nn.Parameter]]) -> dict[_Key, Tensor]:
    sizes: dict[_Key, int] = {}
    for _, p in parameters:
        key = (p.dtype, p.device)
        sizes[key] = sizes.get(key, 0) + p.numel()
    return {key: torch.zeros(size, dtype=key[0], device=key[1]) for key, size in sizes.items()}


def _views(parameters: Sequence[tuple[str, nn.Parameter]], buffers: dict[_Key, Tensor]) -> list[Tensor]:
    """Each parameter's slice of its dtype's flat buffer, shaped like it."""
    offsets = dict.fromkeys(buffers, 0)
    views = []
    for _, p in parameters:
        key = (p.dtype, p.device)
        start = offsets[key]
        offsets[key] = start + p.numel()
        views.append(buffers[key][start : start + p.numel()].view_as(p))
    return views


class _Replay(nn.Module):
    """``functional_call`` swaps tensors of a module's ``forward``; this one's forward is the run's loss."""

    def __init__(self, module: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.module = module
        self._loss_fn = loss_fn

    def forward(self, micro_batch: MicroBatch) -> tuple[Tensor | None, Tensor | None]:
        return self._loss_fn(self.module, micro_batch)


def _replay(
    module: nn.Module,
    parameters: Sequence[tuple[str, nn.Parameter]],
    micro_batches: Sequence[MicroBatch],
    counts: Sequence[float],
    objective: Objective,
    totals: tuple[float, float],
    dtypes: list[torch.dtype],
) -> dict[_Key, Tensor]:
    """This rank's share of g*, Σ_m ∂(w_m · loss_m + aux_m / M)/∂θ, accumulated into flat buffers; the losses'
    dtypes are appended to ``dtypes``."""
    global_count, global_real = totals
    buffers = _flat_buffers(parameters)
    leaves = {}
    for (name, p), view in zip(parameters, _views(parameters, buffers), strict=True):
        leaf = p.detach().requires_grad_(True)  # shares the storage; a new autograd leaf without hooks
        leaf.grad = view  # backward accumulates in place into the flat buffer
        leaves[f"module.{name}"] = leaf
    state = {**leaves, **{f"module.{name}": b.clone() for name, b in module.named_buffers()}}
    replay = _Replay(module, objective.loss_fn)
    for micro_batch, count in zip(micro_batches, counts, strict=True):
        with_aux = objective.with_aux and not micro_batch.filler
        if count == 0 and not with_aux:
            continue  # no item: no gradient (its mean loss is 0/0)
        micro_batch.rng.restore()
        with objective.context():
            loss, aux = torch.func.functional_call(replay, state, (micro_batch,))
        dtypes += [t.dtype for t in (loss, aux) if t is not None]
        total = _weighted(loss, count, objective.loss_reduction, global_count)
        if with_aux and aux is not None:
            total = aux / global_real if total is None else total + aux / global_real
        if total is not None and total.requires_grad:
            total.backward()  # type: ignore[no-untyped-call]
    return buffers


def _weighted(loss: Tensor | None, count: float, reduction: str, global_count: float) -> Tensor | None:
    if loss is None or count == 0:
        return None
    weight = (count if reduction == "mean" else 1.0) / global_count
    return loss * weight


def _relative_error(parameters: Sequence[tuple[str, nn.Parameter]], objective: Sequence[Tensor],
                    device: torch.device) -> Tensor:
    """‖g − g*‖ / ‖g*‖ on the device, in float64 (0 when both are zero, inf when g* is zero and g is not)."""
    difference = torch.zeros((), dtype=torch.float64, device=device)
    reference = torch.zeros((), dtype=torch.float64, device=device)
    for (_, p), expected in zip(parameters, objective, strict=True):
        expected64 = expected.to(device, torch.float64)
        applied = torch.zeros_like(expected64) if p.grad is None else p.grad.detach().to(device, torch.float64)
        difference += (applied - expected64).square().sum()
        reference += expected64.square().sum()
    ratio = (difference / reference).sqrt()
    return torch.where(difference == 0, torch.zeros_like(ratio), ratio)


class Auditor:
    """One run's audits, for a monitor: it records an audited window's micro-batches as their forwards start and
    audits the window's update once (whatever the optimizers), before anything changes its gradient.

    Args:
        schedule: which windows, what a failure does.
        front_end: the monitor's name, for messages.
    """

    def __init__(self, schedule: AuditSchedule, front_end: str) -> None:
        self._schedule = schedule
        self._front_end = front_end
        self.audits: list[Audit] = []
        self._objective: Objective | None = None
        self._precision: str | None = None
        self._recorded: list[MicroBatch] | None = None  # the audited window's micro-batches, until its update
        self._done = False  # the window's audit ran
        self._skipped_tolerance = 0.0  # what a window with nothing to compare reports

    @property
    def enabled(self) -> bool:
        return self._schedule.enabled

    def prepare(self, module: nn.Module, objective: Objective | None, precision: str | None = None) -> None:
        """What the audit recomputes, for ``module``; a ``ValueError`` if the replay cannot audit it."""
        if not self._schedule.enabled or objective is None:
            return
        why = refusal(module)
        if why is not None:
            raise ValueError(
                f"`{self._front_end}(audit_every={self._schedule.every})` cannot audit this model: {why}. Remove"
                " `audit_every` (docs/audit.md, \"Limits\")."
            )
        self._objective, self._precision = objective, precision
        dtype = least_precise([p.dtype for p in module.parameters()])
        self._skipped_tolerance = self._schedule.tolerance_for(dtype, precision)

    def start(self, first_window: int) -> None:
        """A run starts: its first window is ``first_window`` (the optimizer steps taken before it)."""
        self.audits.clear()  # in place: a monitor hands this list out
        self._recorded = None
        self._schedule.start(first_window)

    def micro_batch(self, window: int, first: bool, batch: Any, filler: bool = False, index: int = 0) -> None:
        """A micro-batch's forward is about to run (``first``: its window's first)."""
        if first:
            self._recorded = [] if self._objective is not None and self._schedule.due(window) else None
            self._done = False
        if self._recorded is not None:
            self._recorded.append(MicroBatch(batch, RngState.capture(), filler, index))

    def filler(self) -> None:
        """The micro-batch recorded last is a zero-weight filler (its front end says so from its forward on)."""
        if self._recorded:
            self._recorded[-1] = replace(self._recorded[-1], filler=True)

    def audit(self, module: nn.Module, window: int, device: torch.device, unseen: Callable[[], str]) -> Audit | None:
        """After the window's last backward: its audit (None if it is not audited); every rank of the group must
        call it. A failure raises, warns or logs as the schedule says, naming ``unseen()``."""
        if self._recorded is None or self._done or self._objective is None:
            return None
        self._done = True
        replayed = objective_error(module, self._recorded, self._objective, device=device)
        tolerance = self._schedule.tolerance_for(replayed.dtype, self._precision)
        error = replayed.error
        audit = Audit(window, error, tolerance, error is None or error <= tolerance)
        self.audits.append(audit)
        if not audit.passed:
            message = failure_message(audit, unseen())
            if self._schedule.on_failure == "raise":
                raise AuditError(message)  # the error is the same on every rank: every rank raises
            (rank_zero_warn if self._schedule.on_failure == "warn" else rank_zero_info)(message)
        return audit

    def window_end(self, window: int) -> Audit | None:
        """The window ended: its audit, if it had one (an update the strategy skipped, N = 0, had nothing to
        compare)."""
        recorded, self._recorded = self._recorded, None
        if recorded is None:
            return None
        if not self._done:
            self.audits.append(Audit(window, None, self._skipped_tolerance, True))
        return self.audits[-1]


FABRIC_UNSEEN = (
    "the loop's own scaling of the loss (`fabric.backward(loss / K)` averages micro-batch means, a mean of means:"
    " use `TokenMeanAccumulator`); an `audit_loss` that is not the loop's loss; gradient hooks on parameters or"
    " modules; DDP's reducer and comm hooks; parameters DDP does not reduce (unfrozen after `fabric.setup`); anything"
    " the loop does to `.grad` before the audit"
)


class FabricAuditing:
    """:class:`Auditor` for a Fabric loop (``FabricMonitor``): the loop says when a micro-batch's forward starts
    (:meth:`micro_batch`) and when its window's last backward is done (:meth:`audit`).

    ``loss(model, batch)`` is the loop's loss of one micro-batch on the unwrapped module (a tensor, or a mapping
    with ``"loss"`` and ``"aux_loss"``); the count and the loss reduction are the accumulator's, else the monitor's.
    """

    def __init__(self, schedule: AuditSchedule, loss: object, count_fn: CountFn, loss_reduction: str) -> None:
        if schedule.enabled and not callable(loss):
            raise ValueError(
                f"`audit_every={schedule.every}` needs `audit_loss`, a callable fn(model, batch) -> loss computing the"
                f" micro-batch's loss exactly as the loop does, got {loss!r}."
            )
        self.auditor = Auditor(schedule, "FabricMonitor")
        self._loss = loss
        self._count_fn, self._loss_reduction, self._aux = count_fn, loss_reduction, False
        self._module: nn.Module | None = None  # the unwrapped module, once attached
        self._device = torch.device("cpu")
        self._open = False  # a window's first micro-batch was recorded
        self._windows = 0

    def attach(self, model: Any, count_fn: CountFn | None = None, loss_reduction: str | None = None,
               aux: bool = False) -> None:
        """The model ``fabric.setup`` returned (and the accumulator's count); a ``ValueError`` if it cannot be
        audited."""
        from token_mean import _lightning

        if not self.auditor.enabled:
            return
        modules = _lightning.fabric_modules(model)
        strategy = _lightning.fabric_strategy_of(model)
        if modules is None or strategy is None:
            raise ValueError(f"The audit needs the model `fabric.setup` returned, got {type(model).__name__}.")
        self._module, self._device = modules[1], strategy.root_device
        self._count_fn = count_fn or self._count_fn
        self._loss_reduction, self._aux = loss_reduction or self._loss_reduction, aux
        objective = Objective(self._replayed_loss, self._count_fn, self._loss_reduction, aux,
                              strategy.precision.forward_context)
        self.auditor.prepare(self._module, objective, None)
        self.auditor.start(0)

    def _replayed_loss(self, module: nn.Module, micro_batch: MicroBatch) -> tuple[Tensor | None, Tensor | None]:
        output = self._loss(module, micro_batch.batch)  # type: ignore[operator]
        if isinstance(output, Tensor):
            return output, None
        aux = output.get("aux_loss") if isinstance(output, dict) else None
        loss = output.get("loss") if isinstance(output, dict) else None
        return loss, aux

    def micro_batch(self, model: Any, batch: Any, filler: bool = False) -> None:
        """Before a micro-batch's forward (the first after an audit opens a window)."""
        if self.auditor.enabled and self._module is None:
            self.attach(model)
        self.auditor.micro_batch(self._windows, not self._open, batch, filler)
        self._open = True

    def audit(self, model: Any, unseen: str = FABRIC_UNSEEN) -> Audit | None:
        """After the window's last backward, before clipping and the step: its audit (None if not audited)."""
        window, self._windows, self._open = self._windows, self._windows + 1, False
        if self._module is None:
            return None
        self.auditor.audit(self._module, window, self._device, lambda: unseen)
        return self.auditor.window_end(window)


def failure_message(audit: Audit, unseen: str) -> str:
    """What a failed audit says: the step, the error, the tolerance, and what lies where the audit cannot see."""
    return (
        f"The objective audit failed at optimizer step {audit.step}: the gradient the optimizer is about to"
        f" apply differs from the gradient of the window's token-mean objective by ‖g − g*‖/‖g*‖ = {audit.error:.3e}"
        f" (tolerance {audit.tolerance:.1e}). g* was recomputed by replaying the window's micro-batches on the"
        f" unwrapped module, so the difference comes from what lies between the loss and the optimizer, which the"
        f" audit cannot see: {unseen}. Fix the normalization (e.g. use a token-mean strategy), or raise"
        " `audit_tolerance` if this precision is expected."
    )


__all__ = [
    "Audit",
    "AuditError",
    "AuditSchedule",
    "Auditor",
    "FabricAuditing",
    "MicroBatch",
    "Objective",
    "OnAuditFailure",
    "RngState",
    "audited_parameters",
    "failure_message",
    "least_precise",
    "objective_error",
    "refusal",
]
