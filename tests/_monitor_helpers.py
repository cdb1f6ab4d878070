"""Fixtures for the DenominatorMonitor tests: controlled counts, a CSV-logged run, warnings out of forked workers."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import (
    CLASSES,
    FEATURES,
    Batch,
    ListDataset,
    TokenModule,
    TokenNet,
    initial_state,
    make_optimizer,
    token_loss,
    windows_of,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from token_mean import count_valid_labels
from token_mean.callback import DenominatorMonitor
from token_mean.metrics import TokenMeanLoss

PREFIX = "denominator/"


def batch_with_count(generator: torch.Generator, count: int, rows: int = 2, length: int = 6) -> Batch:
    """One micro-batch with exactly `count` valid targets (the first ones, row-major)."""
    x = torch.randn(rows, length, FEATURES, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (rows * length,), generator=generator)
    labels[count:] = -100
    return {"x": x, "labels": labels.view(rows, length)}


def counts_data(counts: list[list[int]], seed: int = 0) -> list[list[Batch]]:
    """Per-rank micro-batches holding the given numbers of valid targets."""
    generator = torch.Generator().manual_seed(seed)
    return [[batch_with_count(generator, count) for count in rank] for rank in counts]


def count_of(batch: Batch) -> float:
    return float(count_valid_labels(batch))


def exact_trajectory(data: list[list[Batch]], accumulate: int) -> list[tuple[float, float]]:
    """Plain torch, one process: (N, exact token-mean loss before the update) per optimizer step of one epoch."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    steps: list[tuple[float, float]] = []
    for window in windows_of(min(len(rank) for rank in data), accumulate):
        step_batches = [rank[i] for rank in data for i in window]
        total = sum(count_of(b) for b in step_batches)
        optimizer.zero_grad()
        loss = sum(token_loss(net, b, "sum") for b in step_batches) / total
        assert isinstance(loss, torch.Tensor)
        steps.append((total, float(loss.detach())))
        loss.backward()
        optimizer.step()
    return steps


def trainer_for(tmp_path: Path, strategy: Any = "auto", devices: int = 1, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("log_every_n_steps", 1)
    kwargs.setdefault("logger", CSVLogger(tmp_path, name="logs", version=0))
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def logged(tmp_path: Path) -> dict[int, dict[str, float]]:
    """step → the monitor's metrics (prefix removed) that the CSVLogger wrote."""
    steps: dict[int, dict[str, float]] = {}
    with (tmp_path / "logs" / "version_0" / "metrics.csv").open(newline="") as file:
        for row in csv.DictReader(file):
            values = {k.removeprefix(PREFIX): float(v) for k, v in row.items() if k.startswith(PREFIX) and v != ""}
            if values:
                assert int(row["step"]) not in steps, f"step {row['step']} logged twice"
                steps[int(row["step"])] = values
    return steps


class Outcome(Callback):
    """Rank 0 writes the warnings raised during fit and the monitor's verdict, since forked workers return nothing."""

    def __init__(self, path: Path, monitor: DenominatorMonitor) -> None:
        self.path = path
        self.monitor = monitor
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catcher.__exit__(None, None, None)
        if trainer.global_rank == 0:
            divergence = self.monitor.first_divergence
            outcome = {
                "warnings": [str(w.message) for w in self._caught if "DenominatorMonitor" in str(w.message)],
                "divergence": None if divergence is None else [divergence.step, divergence.quantity],
            }
            self.path.write_text(json.dumps(outcome))


class ValidationModule(TokenModule):
    """Logs the validation loss twice: exactly (TokenMeanLoss) and as Lightning's default `sync_dist` mean."""

    def __init__(self, data: list[list[Batch]]) -> None:
        super().__init__(data)
        self.val_loss = TokenMeanLoss()

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        loss = token_loss(self.net, batch)
        self.val_loss.update(loss, count_valid_labels(batch))
        self.log("val_token_mean", self.val_loss, on_epoch=True)
        self.log("val_sync_dist", loss, on_epoch=True, sync_dist=True, batch_size=len(batch["labels"]))

    def val_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(ListDataset(self.data[self.global_rank]), batch_size=None)
