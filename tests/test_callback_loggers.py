"""DenominatorMonitor through Lightning's CSV and TensorBoard loggers at once: the same metrics at the same steps."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from _harness import FORK, TokenModule, windows_of
from _monitor_helpers import PREFIX, count_of, counts_data, trainer_for
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from token_mean.callback import DenominatorMonitor

MONITOR_METRICS = {"global_count", "rank_count_min", "rank_count_max", "rank_count_mean", "window_length",
                   "imbalance", "naive_weight_error", "loss", "items_per_sec", "naive_loss"}


def csv_metrics(path: Path) -> dict[str, dict[int, float]]:
    """Monitor metric → step → value, as CSVLogger wrote them."""
    metrics: dict[str, dict[int, float]] = {}
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            for key, value in row.items():
                if key.startswith(PREFIX) and value != "":
                    metrics.setdefault(key.removeprefix(PREFIX), {})[int(row["step"])] = float(value)
    return metrics


def tensorboard_metrics(folder: Path) -> dict[str, dict[int, float]]:
    """Monitor metric → step → value, as TensorBoardLogger wrote them (scalars are stored as float32)."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag.removeprefix(PREFIX): {event.step: event.value for event in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
        if tag.startswith(PREFIX)
    }


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_csv_and_tensorboard_receive_the_same_metrics(tmp_path: Path, devices: int) -> None:
    counts = [[3, 5, 0, 7, 2], [6, 1, 4, 4, 9]][:devices]  # step 1 holds a micro-batch without valid items
    data = counts_data(counts)
    loggers = [CSVLogger(tmp_path, name="csv", version=0), TensorBoardLogger(tmp_path, name="tb", version=0)]
    strategy = DDPStrategy(**FORK) if devices > 1 else "auto"
    trainer_for(tmp_path, strategy, devices=devices, accumulate_grad_batches=2, logger=loggers,
                callbacks=[DenominatorMonitor()]).fit(TokenModule(data))

    from_csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    from_tensorboard = tensorboard_metrics(tmp_path / "tb" / "version_0")
    assert set(from_csv) == set(from_tensorboard) == MONITOR_METRICS
    windows = windows_of(5, 2)
    for name, by_step in from_csv.items():
        assert sorted(by_step) == list(range(len(windows))), name  # one entry per optimizer step, at its step
        # float32 in the event file; naive_loss is NaN at step 1 (Lightning's mean over no valid item), in both
        assert from_tensorboard[name] == pytest.approx(by_step, rel=1e-6, nan_ok=True), name
    expected_counts = [sum(count_of(rank[i]) for rank in data for i in window) for window in windows]
    assert [from_csv["global_count"][step] for step in range(len(windows))] == expected_counts
    assert [from_tensorboard["global_count"][step] for step in range(len(windows))] == expected_counts
    assert torch.tensor(list(from_csv["loss"].values())).isfinite().all()  # the exact loss skips the empty batch
    # with two ranks the per-rank counts differ (and only rank zero wrote: one value per step, checked above)
    assert (from_csv["rank_count_min"] != from_csv["rank_count_max"]) == (devices == 2)
