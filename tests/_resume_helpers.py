"""Checkpoint and resume: a loader Lightning can resume mid-epoch, and forked runs that save or resume checkpoints."""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import Batch, ListDataset, Recorder, TokenModule, strategy_for
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from token_mean import TokenMeanDDPStrategy

CHECKPOINT_EVERY = 2  # optimizer steps between checkpoints


class PositionLoader(DataLoader[Batch]):
    """A loader that resumes mid-epoch: its state is the number of batches it has handed out this epoch.

    Lightning treats a loader with ``state_dict``/``load_state_dict`` as resumable and saves its state in every
    checkpoint. After ``load_state_dict`` the next iteration skips the batches the interrupted run had consumed; a
    position at or past this loader's end (a state saved after the epoch's last batch) starts the next epoch.
    """

    def __init__(self, dataset: ListDataset) -> None:
        super().__init__(dataset, batch_size=None)
        self.handed_out = 0
        self.resume_at = 0

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        start, self.resume_at = self.resume_at, 0
        self.handed_out = start
        for batch in itertools.islice(super().__iter__(), start, None):
            self.handed_out += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        position = state_dict["handed_out"]
        self.resume_at = position if position < len(self) else 0


class ResumableModule(TokenModule):
    """`TokenModule` whose training loader is a :class:`PositionLoader` (``stateful=True``) or a plain DataLoader."""

    def __init__(self, data: list[list[Batch]], stateful: bool) -> None:
        super().__init__(data)
        self.stateful = stateful

    def train_dataloader(self) -> DataLoader[Batch]:
        dataset = ListDataset(self.data[self.global_rank])
        return PositionLoader(dataset) if self.stateful else DataLoader(dataset, batch_size=None)


class StrategyStateRecorder(Callback):
    """Rank 0 writes the strategy's own counters at the end of training (forked workers cannot return them)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if trainer.global_rank == 0 and isinstance(strategy, TokenMeanDDPStrategy):
            self.path.write_text(repr(strategy.skipped_steps))


class SaveAtBatch(Callback):
    """Save a checkpoint after one batch of the first epoch, wherever it falls in its accumulation window.

    Lightning does the same for a `ModelCheckpoint(train_time_interval=...)`, a checkpoint after a mid-epoch
    validation, or SLURM's pre-emption signal.
    """

    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path = path
        self.batch_idx = batch_idx

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 0 and batch_idx == self.batch_idx:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.save_checkpoint(self.path)
            if trainer.global_rank == 0:  # the warnings saving gave, for the test to read
                self.path.with_suffix(".warnings.json").write_text(json.dumps([str(w.message) for w in caught]))


class BatchLog(Callback):
    """Rank 0 writes which of its batches (by the sum of their inputs) each `batch_idx` trained on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[tuple[int, int, float]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Batch, batch_idx: int
    ) -> None:
        self.seen.append((trainer.current_epoch, batch_idx, float(batch["x"].sum())))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.seen))


def fit_checkpointed(
    module: ResumableModule,
    mode: str,
    out: Path,
    ckpt_path: Path | None = None,
    accumulate: int = 2,
    epochs: int = 2,
    callbacks: Sequence[Callback] = (),
    every: int = CHECKPOINT_EVERY,
    **trainer_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Train with two forked gloo ranks (`mode` "plain": plain DDP), saving a checkpoint every `every` optimizer
    steps to ``out/checkpoints``.

    With `ckpt_path`, resume from it. Returns rank 0's final parameters; the window stats are in ``out``.
    """
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=every, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_for(mode),
        accumulate_grad_batches=accumulate,
        max_epochs=epochs,
        callbacks=[Recorder(out), StrategyStateRecorder(out / "skipped_steps.txt"), checkpoints, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    params = torch.load(out / "params.pt", weights_only=True)
    return {k.removeprefix("net."): v for k, v in params.items()}


def checkpoint_at(out: Path, step: int) -> Path:
    """The checkpoint `fit_checkpointed` saved after optimizer step `step`."""
    (path,) = (out / "checkpoints").glob(f"epoch=*-step={step}.ckpt")
    return path
