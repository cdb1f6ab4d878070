"""``DenominatorMonitor``: log what denominator each optimizer step used, and catch a run drifting from a reference.

The callback wires Lightning's hooks to the framework-free parts: the window's numbers (a token-mean strategy's
``last_window``, or ``_measure.MeasuredWindow`` under any other strategy), the step's fingerprints
(``_fingerprint``) and the trace and comparison (``_observe.Observer``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from token_mean import _lightning
from token_mean._audit import Auditor, AuditSchedule, MicroBatch, Objective, OnAuditFailure
from token_mean._counting import CountFn
from token_mean._counts import count_valid_labels
from token_mean._fingerprint import global_norm, grad_norm
from token_mean._measure import Measured, Published, Windows, measured_world
from token_mean._mode import LossReduction
from token_mean._observe import MonitorSettings, Observer, OnDivergence
from token_mean.results import Audit, Divergence, WindowStats
from token_mean.strategy import TokenMeanStrategy


class DenominatorMonitor(Callback):
    r"""Log, per optimizer step, the global denominator N the update used, and compare the run with a reference.

    At the end of every accumulation window the monitor logs, under ``prefix``: ``global_count`` (N), the per-rank
    counts' ``rank_count_min``/``max``/``mean``, ``window_length``, ``imbalance`` (max n_r / mean n_r),
    ``naive_weight_error`` (max_r \|P·n_r/N − 1\|: how much a mean of rank means mis-weights a rank), the exact
    token-mean ``loss`` (Σ loss sums / N), ``aux_loss`` when ``training_step`` returns one, ``items_per_sec``, and,
    without a token-mean strategy, ``naive_loss`` (what plain DDP differentiated). Under a
    :class:`~token_mean.TokenMeanStrategy` the numbers are the strategy's ``last_window`` (P more floats in each
    window's record, no collective of its own); under any other strategy the monitor measures them itself (one
    all-reduce per window, and a bad count raises the same :class:`~token_mean.DenominatorError` on every rank).
    Metrics go to ``trainer.loggers`` from rank zero under the step Lightning logs the batch's own ``self.log``
    values under, when Lightning logs them or every ``logging_interval`` steps.

    ``record="ref.csv"`` (or ``.jsonl``) writes one trace row per step from rank zero (``step``, ``global_count``,
    ``loss``, ``grad_norm`` before clipping, ``param_norm`` after the update, and for reading only ``world_size``,
    ``window_length``, ``imbalance``, ``naive_weight_error``); ``reference="ref.csv"`` compares each step with such
    a trace and reports the first step and quantity outside ``atol + rtol·|reference|`` (N within a relative 1e-9).
    Recording or comparing costs one pass over the gradients and one over the parameters per step and one
    device-to-host copy. Every rank compares, so with ``on_divergence="raise"`` all ranks raise together; the trace
    file must be readable on every rank. The metrics and costs are detailed in ``docs/monitor.md``.

    Args:
        count_fn: the valid items of one micro-batch, used only without a token-mean strategy. Defaults to the
            strategy's ``count_fn`` if it has one, else :func:`~token_mean.count_valid_labels`.
        loss_reduction: ``"mean"`` if ``training_step`` returns the micro-batch's mean loss, ``"sum"`` if it returns
            the sum. Defaults to the strategy's ``loss_reduction``, else ``"mean"``.
        logging_interval: log every this many optimizer steps; ``None`` logs when Lightning logs step metrics.
        prefix: the metric names' prefix, ``"{prefix}/global_count"`` and so on.
        record: write the trace of this run to this ``.csv`` or ``.jsonl`` file (overwritten at the start of fit).
        reference: compare every step of this run with this trace.
        rtol: relative tolerance of the comparison.
        atol: absolute tolerance of the comparison.
        on_divergence: at the first divergent step, ``"warn"`` warns, ``"raise"`` raises
            :class:`~token_mean.DivergenceError` on every rank, ``"log"`` logs ``{prefix}/reference_divergence`` at
            every step and says it once through ``rank_zero_info``.
        audit_every, on_audit_failure, audit_tolerance: the objective audit (``docs/audit.md``) of the first window
            and every ``audit_every``-th after it, under any strategy: ``.grad`` against a replay of the window's
            token-mean gradient, logged as ``{prefix}/audit_error`` and kept in :attr:`audits`.

    Raises:
        AuditError: with ``on_audit_failure="raise"``, at the first audited window whose gradient is wrong.
        ValueError: at fit start, with ``audit_every``, for a model the replay cannot audit (DTensor parameters,
            ``SyncBatchNorm``); if a setting is out of range, a trace suffix is not
            ``.csv``/``.jsonl``/``.ndjson``, or ``record`` and ``reference`` are the same file; at fit start, if
            the reference is malformed or covers a different number of optimizer steps than this run.
        TypeError: if ``count_fn`` is not callable.
        DivergenceError: with ``on_divergence="raise"``, at the first divergent step.

    Example:
        >>> import lightning.pytorch as pl
        >>> monitor = DenominatorMonitor(record="runs/ref.csv")  # a trusted run: 1 device, the same global batches
        >>> trainer = pl.Trainer(callbacks=[monitor], accumulate_grad_batches=4, logger=False)
        >>> replay = DenominatorMonitor(reference="runs/ref.csv", on_divergence="raise", rtol=1e-4)
        >>> replay.logging_interval is None
        True
    """

    def __init__(
        self,
        count_fn: CountFn | None = None,
        loss_reduction: LossReduction | None = None,
        logging_interval: int | None = None,
        prefix: str = "denominator",
        record: str | os.PathLike[str] | None = None,
        reference: str | os.PathLike[str] | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-6,
        on_divergence: OnDivergence = "warn",
        audit_every: int | None = None,
        on_audit_failure: OnAuditFailure = "warn",
        audit_tolerance: float | None = None,
    ) -> None:
        _check_measurement(count_fn, loss_reduction)
        self._auditing = Auditor(AuditSchedule(audit_every, on_audit_failure, audit_tolerance), "DenominatorMonitor")
        self.audits: list[Audit] = self._auditing.audits  # every audited window of the last fit, in order
        self._settings = MonitorSettings.checked(
            logging_interval, prefix, record, reference, rtol, atol, on_divergence, "the Trainer's `log_every_n_steps`",
            "DenominatorMonitor",
        )
        self.logging_interval = logging_interval
        self._count_fn_arg = count_fn
        self._loss_reduction_arg = loss_reduction
        self.last_window: WindowStats | None = None
        """The window of the last optimizer step, as logged."""
        self._observer: Observer | None = None  # from `setup` (it reads the reference)
        self._objective: Objective | None = None  # what the audit recomputes, from `setup`
        self._strategy: TokenMeanStrategy | None = None  # the token-mean strategy whose windows are logged
        self._windows: Windows = Measured(count_valid_labels, "mean")  # where each window's numbers come from
        self._window_started_at = 0.0
        self._window_length = 0
        self._grad_norm: Tensor | None = None
        self._step_at_batch_start = 0

    @property
    def first_divergence(self) -> Divergence | None:
        """The first divergent step of the last fit (set on every rank), ``None`` if none or no reference."""
        return None if self._observer is None else self._observer.first_divergence

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        self._strategy = strategy if isinstance(strategy, TokenMeanStrategy) else None
        if self._strategy is not None:
            self._strategy.track_rank_counts()  # the per-rank figures need every rank's count
        count_fn, reduction = _measured_by(self._count_fn_arg, self._loss_reduction_arg, self._strategy)
        self._windows = Measured(count_fn, reduction) if self._strategy is None else Published(self._strategy)
        self._observer = Observer(self._settings)
        aux = self._strategy is not None and self._strategy.mode == "lookahead"  # the strategy's objective has it
        self._objective = _trainer_objective(trainer, count_fn, reduction, aux, self._auditing.enabled)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._observer is None:  # `setup` of another stage
            return
        self.last_window = None
        self._reset_window()
        world = measured_world(trainer)  # the ranks that share the denominator: the measurement's and the audit's
        self._windows.start(trainer, world)
        self._auditing.prepare(pl_module, self._objective, world, str(trainer.precision))  # sharded after `setup`
        self._auditing.start(trainer.global_step)
        self._observer.start(trainer.is_global_zero, trainer.global_step, trainer.estimated_stepping_batches)

    def _reset_window(self) -> None:
        self._window_length = 0
        self._grad_norm = None
        self._windows.reset()

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_window()  # Lightning restarts windows every epoch

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._window_length == 0:
            self._window_started_at = time.perf_counter()
        self._auditing.micro_batch(trainer.global_step, self._window_length == 0, batch, False, batch_idx)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self._strategy is not None and self._strategy.is_filler_batch:  # known from the micro-batch's forward on
            self._auditing.filler()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        # callbacks' hooks run before the module's, and clipping after both: `.grad` is what the update would use
        self._auditing.audit(pl_module, trainer.global_step, lambda: _unseen(pl_module, self._strategy, trainer))
        if self._observer is not None and self._observer.fingerprints:
            self._grad_norm = grad_norm(pl_module, trainer.strategy.root_device)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        observer = self._observer
        if observer is None:
            return
        self._windows.add(trainer, pl_module, batch, outputs, batch_idx, self._step_at_batch_start)
        self._window_length += 1
        if not _lightning.steps_after_this_batch(trainer):
            return  # still accumulating
        step, gradient = self._step_at_batch_start, self._grad_norm
        elapsed = time.perf_counter() - self._window_started_at
        stats, naive_loss = self._windows.finish(step)
        self._reset_window()
        audit = self._auditing.window_end(step)
        if stats is None:
            return
        self.last_window = stats
        _lightning.show_on_progress_bar(trainer, _bar_values(stats))
        norms = (gradient, _param_norm(trainer, pl_module)) if observer.fingerprints else (None, None)
        audit_error = None if audit is None else audit.error
        metrics, divergent = observer.window(step, stats, elapsed, norms, naive_loss, audit_error)
        if _should_log(trainer, self.logging_interval, step) or divergent or audit_error is not None:
            _log_metrics(trainer, metrics, step)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self._observer is not None:
            self._observer.close()


BAR_LOSS, BAR_COUNT = "exact_loss", "N"
"""The progress bar's names of the step's exact token-mean loss and its N (docs/monitor.md)."""


def _bar_values(stats: WindowStats) -> dict[str, float]:
    """What the bar shows after a step: Lightning's own `train_loss` there is the last micro-batch's loss. Host
    floats the window already read: no tensor, no host read. A step without items shows NaN, not the last loss."""
    return {BAR_LOSS: math.nan if stats.loss is None else stats.loss, BAR_COUNT: stats.global_count}


def _param_norm(trainer: Trainer, pl_module: LightningModule) -> Tensor | None:
    return global_norm([p.detach() for p in pl_module.parameters()], trainer.strategy.root_device)


def _log_metrics(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _should_log(trainer: Trainer, interval: int | None, step: int) -> bool:
    if interval is None:
        return _lightning.should_update_logs(trainer)  # when Lightning logs the batch's own `self.log` values
    return (step + 1) % interval == 0 or trainer.should_stop


def _trainer_objective(trainer: Trainer, count_fn: CountFn, reduction: str, aux: bool, audited: bool) -> Objective:
    """What the audit recomputes under the Trainer: ``training_step``'s loss, under its precision context."""
    _check_auditable(trainer.lightning_module, audited)
    context = trainer.strategy.precision_plugin.train_step_context
    return Objective(_training_step_loss, count_fn, reduction, aux, context)


def _check_auditable(pl_module: LightningModule, audited: bool) -> None:
    if audited and not pl_module.automatic_optimization:
        raise ValueError(
            "`DenominatorMonitor(audit_every=...)` needs automatic optimization: with `automatic_optimization ="
            " False`, `training_step` calls backward and the optimizer itself, so replaying it would train. Remove"
            " `audit_every`."
        )


def _measured_by(
    count_fn: CountFn | None, loss_reduction: LossReduction | None, strategy: TokenMeanStrategy | None
) -> tuple[CountFn, LossReduction]:
    """The count and loss reduction the monitor measures and audits with: the strategy's, else the monitor's."""
    if strategy is not None and count_fn is not None and count_fn is not strategy.count_fn:
        rank_zero_warn(
            "`DenominatorMonitor(count_fn=...)` is ignored: the monitor logs the counts of"
            f" `{type(strategy).__name__}`, which uses its own `count_fn`. Pass `count_fn` to the strategy instead."
        )
    if strategy is not None:
        return strategy.count_fn, loss_reduction or strategy.loss_reduction
    return count_fn or count_valid_labels, loss_reduction or "mean"


def _check_measurement(count_fn: object, loss_reduction: object) -> None:
    if count_fn is not None and not callable(count_fn):
        raise TypeError(
            f"`count_fn` must be a callable batch -> count, got {type(count_fn).__name__}: {count_fn!r}."
            " Pass e.g. `count_fn=lambda batch: (batch['labels'] != -100).sum()`, or leave it out."
        )
    if loss_reduction not in (None, "mean", "sum"):
        raise ValueError(
            f"`loss_reduction` must be 'mean' (training_step returns the mean loss) or 'sum', got {loss_reduction!r}."
        )


def _training_step_loss(module: torch.nn.Module, micro_batch: MicroBatch) -> tuple[Tensor | None, Tensor | None]:
    """The micro-batch's loss and ``aux_loss`` as ``training_step`` returns them, its ``self.log`` calls dropped."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    assert isinstance(module, LightningModule)
    step = module.training_step
    args: tuple[Any, ...] = (micro_batch.batch, micro_batch.index)
    if not is_param_in_hook_signature(step, "batch_idx", min_args=2):
        args = args[:1]
    # instance attributes shadow the methods for the replay only: the run's logged metrics stay as they were
    module.log, module.log_dict = _ignore, _ignore  # type: ignore[method-assign]
    try:
        output = step(*args)
    finally:
        del module.log, module.log_dict
    if isinstance(output, Tensor):
        return output, None
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        aux = output.get("aux_loss")
        return output["loss"], aux if isinstance(aux, Tensor) else None
    return None, None  # a skipped micro-batch: no gradient


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _unseen(pl_module: LightningModule, strategy: TokenMeanStrategy | None, trainer: Trainer) -> str:
    """What lies between the loss and the optimizer, the suspects present in this run named first."""
    present = []
    if strategy is None:
        present.append(
            f"`{type(trainer.strategy).__name__}`, which does not normalize by N (Lightning divides each micro-batch"
            " by K and DDP averages the ranks: a mean of means; use `TokenMeanDDPStrategy`)"
        )
    for hook in ("backward", "on_after_backward", "optimizer_step"):
        if getattr(type(pl_module), hook) is not getattr(LightningModule, hook):
            present.append(f"the `LightningModule.{hook}` override")
    present.append(
        "gradient hooks on parameters or modules, DDP's reducer and comm hooks, parameters DDP does not reduce"
        " (unfrozen after wrapping), callbacks' `on_before_optimizer_step` that ran before the monitor's"
    )
    return "; ".join(present)


__all__ = ["DenominatorMonitor"]
