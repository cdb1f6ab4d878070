"""The examples end to end: the template ``train_masked_lm.py`` on 2 CPU processes, and the demo ``masked_lm.py``
(reference vs token-mean vs plain DDP, as ``make demo`` runs it) with tiny settings."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# The examples are scripts, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import masked_lm
import train_masked_lm

EXAMPLES = Path(masked_lm.__file__).parent

# The token-mean run must match the reference to float32 round-off at every step: ~1e-7 relative over a few steps,
# where plain DDP is off by ~1e-3 or more from the second step on.
LOSS_RTOL = 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_template_trains_on_two_cpu_processes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable, str(EXAMPLES / "train_masked_lm.py"), "--accelerator=cpu", "--devices=2", "--accumulate=2",
        "--max-steps=4", "--eval-every=2", "--micro-batch-size=2", "--limit=80", f"--out={out}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"written to {out}" in done.stdout

    with (out / "trace.csv").open(newline="") as file:
        trace = list(csv.DictReader(file))
    assert [int(row["step"]) for row in trace] == [0, 1, 2, 3]
    assert all(row["world_size"] == "2" and float(row["global_count"]) > 0 for row in trace)
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 4
    assert (out / "csv" / "metrics.csv").stat().st_size > 0


def test_template_accepts_a_gpu() -> None:
    args = train_masked_lm.parse_args(["--accelerator", "gpu", "--devices", "8", "--precision", "bf16-mixed"])
    assert (args.accelerator, args.devices, args.precision) == ("gpu", "8", "bf16-mixed")


def test_reference_batches_are_the_ddp_steps() -> None:
    """The reference's batch of every step is the union of what the P ranks' loaders feed that step, every epoch."""
    dataset = cast(Dataset[int], list(range(29)))  # 15 per rank, 8 micro-batches: a short last window
    devices, accumulate, micro_batch_size = 2, 3, 2
    reference = masked_lm.GlobalBatches(dataset, devices, accumulate, micro_batch_size, seed=5)
    epochs = []
    for epoch in (0, 1):
        _set_sampler_epoch(DataLoader(dataset, batch_sampler=reference), epoch)  # as Lightning does at an epoch start
        ranks: list[list[list[int]]] = []
        for rank in range(devices):
            # What Lightning puts behind the template's `DataLoader(shuffle=True)` on rank `rank` of P.
            sampler: DistributedSampler[int] = DistributedSampler(dataset, devices, rank, shuffle=True, seed=5)
            sampler.set_epoch(epoch)
            ranks.append([batch.tolist() for batch in DataLoader(dataset, micro_batch_size, sampler=sampler)])
        windows = [
            [index for micro_batches in ranks for batch in micro_batches[start : start + accumulate] for index in batch]
            for start in range(0, len(ranks[0]), accumulate)
        ]
        assert list(reference) == windows and len(reference) == len(windows) == 3
        epochs.append(windows)
    assert epochs[0] != epochs[1]


@pytest.mark.distributed
@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    command = [
        sys.executable, str(EXAMPLES / "masked_lm.py"), "--steps=3", "--micro-batch-size=1", "--limit=60",
        f"--out={out}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith(f"Run folder: {out}")
    # One line per run and the table: no progress bars, model summaries or Lightning banners from the sub-runs.
    assert len(done.stdout.splitlines()) <= 15, done.stdout
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("run ")] == [
        "run 1/3", "run 2/3", "run 3/3"
    ]  # fmt: skip
    for noise in ("Epoch 0", "GPU available", "Initializing distributed", "Trainable params"):
        assert noise not in done.stdout + done.stderr

    summary = json.loads((out / "summary.json").read_text())
    losses = summary["losses"]
    assert len(losses["reference"]) == 3
    for step, (reference, token_mean) in enumerate(zip(losses["reference"], losses["token_mean"], strict=True)):
        assert abs(token_mean - reference) <= LOSS_RTOL * abs(reference), f"step {step}: {token_mean} vs {reference}"
    runs = summary["runs"]
    assert runs["token_mean"]["first_flagged_step"] is None
    assert runs["naive"]["first_flagged_step"] is not None
    assert runs["naive"]["max_abs_loss_deviation"] > 100 * runs["token_mean"]["max_abs_loss_deviation"]
    assert len({run["data_digest"] for run in runs.values()}) == 1
    val_losses = runs["reference"]["val_loss"], runs["token_mean"]["val_loss"]
    assert abs(val_losses[1] - val_losses[0]) <= LOSS_RTOL * val_losses[0]

    assert (out / "loss_curves.png").stat().st_size > 0
    for run in ("reference", "token_mean", "naive"):
        with (out / run / "trace.csv").open(newline="") as file:
            assert len(list(csv.DictReader(file))) == 3
        assert (out / run / "csv" / "metrics.csv").stat().st_size > 0
