"""``DenominatorMonitor``: log what denominator each optimizer step used, and catch a run drifting from a reference."""

from __future__ import annotations

import math
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
from token_mean._audit import Recorded
from token_mean._counts import count_valid_labels
from token_mean._exit import destroy_process_group_at_exit
from token_mean._fingerprint import grad_norm
from token_mean._layout import World, shared_world
from token_mean._measure import MeasuredWindow
from token_mean._monitor import Monitoring, audited, objective, replayed
from token_mean._settings import LossReduction
from token_mean.results import WindowStats
from token_mean.strategy import TokenMeanStrategy

BAR_LOSS, BAR_COUNT = "exact_loss", "N"
"""The progress bar's names of the step's exact token-mean loss and its N (docs/monitor.md)."""


class DenominatorMonitor(Monitoring, Callback):
    r"""Log, per optimizer step, the global denominator N the update used, and compare the run with a reference.

    Per window it logs N (``global_count``), the per-rank counts, the exact ``loss`` and the other metrics of
    ``docs/monitor.md`` to ``trainer.loggers`` from rank zero, and shows the exact loss and N on the progress bar.
    Under a :class:`~token_mean.TokenMeanStrategy` they are its ``last_window``, elsewhere measured (one all-reduce
    per window). ``record`` writes a trace; ``reference`` compares each step with one.

    Args: those of ``_monitor.Monitoring``; under a token-mean strategy ``count_fn`` and ``loss_reduction`` are the
    strategy's, and the audit replays ``training_step`` unless ``audit_loss`` is given.

    Raises:
        AuditError: with ``on_audit_failure="raise"``, at the first audited window whose gradient is wrong.
        DivergenceError: with ``on_divergence="raise"``, at the first divergent step.
        ValueError, TypeError: for a bad setting; at fit start, for a model the audit cannot replay or a bad reference.

    Example:
        >>> import lightning.pytorch as pl
        >>> monitor = DenominatorMonitor(record="runs/ref.csv")  # a trusted run: 1 device, the same global batches
        >>> trainer = pl.Trainer(callbacks=[monitor], accumulate_grad_batches=4, logger=False)
        >>> replay = DenominatorMonitor(reference="runs/ref.csv", on_divergence="raise", rtol=1e-4)
        >>> replay.logging_interval is None
        True
    """

    _count_fn: Any = None  # what the monitor measures and audits with, from `setup` (None: not fitting)
    _reduction: LossReduction = "mean"
    _strategy: TokenMeanStrategy | None = None  # the token-mean strategy whose windows are logged, from `setup`
    _world: World | None = None  # the measurement's ranks, under any other strategy, from `on_train_start`
    _measured: MeasuredWindow | None = None  # the window being measured
    _published: WindowStats | None = None  # the strategy's last window already logged
    _warned = False
    _started_at = 0.0
    _length = 0  # micro-batches of the window so far
    _grad_norm: Tensor | None = None
    _step = 0  # the optimizer step of the batch in flight

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        self._strategy = strategy if isinstance(strategy, TokenMeanStrategy) else None
        if self._strategy is not None:
            self._strategy.track_rank_counts()  # the per-rank figures need every rank's count
            if self.count_fn is not None and self.count_fn is not self._strategy.count_fn:
                rank_zero_warn(
                    "`DenominatorMonitor(count_fn=...)` is ignored: the monitor logs the counts of"
                    f" `{type(strategy).__name__}`, which uses its own `count_fn`. Pass `count_fn` to the strategy."
                )
            self._count_fn, reduction = self._strategy.count_fn, self._strategy.loss_reduction
        else:
            self._count_fn, reduction = self.count_fn or count_valid_labels, "mean"
        self._reduction = self.loss_reduction or reduction
        self._read_reference(tuple(term.name for term in self._strategy.settings.terms) if self._strategy else ())
        if self._auditor.enabled and not pl_module.automatic_optimization:
            raise ValueError(
                "`DenominatorMonitor(audit_every=...)` needs automatic optimization: with `automatic_optimization ="
                " False`, `training_step` calls backward and the optimizer itself, so replaying it would train. Remove"
                " `audit_every`."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._count_fn is None:  # `setup` of another stage
            return
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        world = shared_world(trainer.strategy, model)  # the ranks that share N: the measurement's and the audit's
        if self._strategy is None:
            if world.distributed or trainer.world_size > 1:
                destroy_process_group_at_exit()  # the measurement's collectives run on a group a plain strategy keeps
            self._world = world
        loss = _training_step_output if self.audit_loss is None else replayed(self.audit_loss)
        context = trainer.strategy.precision_plugin.train_step_context
        settings = self._strategy.settings if self._strategy is not None else None
        audited_objective = objective(loss, self._count_fn, self._reduction, context, settings)
        self._auditor.prepare(pl_module, audited_objective, world, str(trainer.precision))  # sharded after `setup`
        self._auditor.start(trainer.global_step)
        self._published, self._warned = None, False
        self._start_run(trainer.is_global_zero, trainer.global_step, trainer.estimated_stepping_batches)
        self._new_window()

    def _new_window(self) -> None:
        self._length, self._grad_norm, self._measured = 0, None, None

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._new_window()  # Lightning restarts windows every epoch

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step
        if self._length == 0:
            self._started_at = time.perf_counter()
        self._auditor.micro_batch(trainer.global_step, self._length == 0, batch, False, batch_idx)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self._strategy is not None and self._strategy.is_filler_batch:  # known from the micro-batch's forward on
            self._auditor.filler()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        # callbacks' hooks run before the module's, and clipping after both: `.grad` is what the update would use
        self._auditor.audit(pl_module, trainer.global_step, lambda: _unseen(pl_module, self._strategy, trainer))
        if self.fingerprints:
            self._grad_norm = grad_norm(pl_module, trainer.strategy.root_device)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._count_fn is None:  # not fitting
            return
        if self._strategy is None and self._world is not None:
            if self._measured is None:
                self._measured = MeasuredWindow(self._world, self._reduction == "mean", self._step, batch_idx)
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            # Lightning divided the closure loss by K under automatic optimization
            accumulate = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self._measured.add(batch, loss, self._count_fn, accumulate)
        self._length += 1
        if not _lightning.steps_after_this_batch(trainer):
            return  # still accumulating
        step, gradient, elapsed = self._step, self._grad_norm, time.perf_counter() - self._started_at
        stats, naive_loss = self._window_stats(step)
        self._new_window()
        if stats is None:
            return
        stats = audited(stats, self._auditor.window_end(step))
        _lightning.show_on_progress_bar(trainer, progress_bar(stats))
        device = trainer.strategy.root_device
        metrics, log_now = self._window(step, stats, elapsed, gradient, pl_module, device, naive_loss)
        if self.logging_interval is None:
            due = _lightning.should_update_logs(trainer)
        else:
            due = (step + 1) % self.logging_interval == 0 or trainer.should_stop
        if (due or log_now) and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _window_stats(self, step: int) -> tuple[WindowStats | None, float | None]:
        """The ended window, the strategy's (None, warned once, if unpublished) or the measured one with DDP's loss."""
        if self._strategy is None:
            window, self._measured = self._measured, None
            return (None, None) if window is None else window.end()
        stats = self._strategy.last_window
        if stats is not None and stats is not self._published:
            self._published = stats
            return stats, None
        if not self._warned:
            self._warned = True
            rank_zero_warn(
                f"`{type(self._strategy).__name__}` published no `last_window` for optimizer step {step};"
                " DenominatorMonitor logs nothing for such steps."
            )
        return None, None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.close()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.close()


def _training_step_output(module: torch.nn.Module, micro_batch: Recorded) -> Any:
    """What ``training_step`` returns for the micro-batch, its ``self.log`` calls dropped."""
    if not isinstance(module, LightningModule):
        raise RuntimeError("token_mean: internal error: the audit replays a module that is not a LightningModule.")
    return _lightning.replay_training_step(module, micro_batch.batch, micro_batch.index)


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


def progress_bar(stats: WindowStats) -> dict[str, float]:
    """The loss and N on the bar; with several terms each term's N (its own unit), never their sum.

    Example:
        >>> term = WindowStats(16.0, 8.0, None, 2, 0.5, False, "lookahead")
        >>> progress_bar(WindowStats(189.0, 90.0, None, 2, 2.5, False, "lookahead", terms={"cls": term}))
        {'exact_loss': 2.5, 'N_cls': 16}
    """
    counts = {f"{BAR_COUNT}_{name}": term.global_count for name, term in (stats.terms or {}).items()}
    counts = counts or {BAR_COUNT: stats.global_count}
    # an integral count as an int: the bar pads floats to "13263.000"
    shown = {name: int(count) if count.is_integer() else count for name, count in counts.items()}
    return {BAR_LOSS: math.nan if stats.loss is None else stats.loss, **shown}


__all__ = ["BAR_COUNT", "BAR_LOSS", "DenominatorMonitor"]
