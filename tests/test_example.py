"""The examples end to end: the template ``train_masked_lm.py`` and the Fabric template ``fabric_masked_lm.py`` on 2
CPU processes, and the demo ``masked_lm.py`` (reference vs token-mean vs plain DDP, as ``make demo`` runs it) with
tiny settings."""

from __future__ import annotations

import csv
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch
from _jobs import run_bounded, run_job
from _old_torch import FSDP2_RUNS_ON_CPU, NO_FSDP2_ON_CPU
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# The examples are scripts, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import fabric_masked_lm
import masked_lm
import stdlib_corpus
import train_masked_lm

EXAMPLES = Path(masked_lm.__file__).parent

# The token-mean run must match the reference to float32 round-off at every step: ~1e-7 relative over a few steps,
# where plain DDP is off by ~1e-3 or more from the second step on.
LOSS_RTOL = 1e-5


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.script  # a user's script end to end: `make test-scripts`, which CI runs beside `make test`
def test_template_trains_on_two_cpu_processes(tmp_path: Path) -> None:
    """76 pairs on 2 processes in micro-batches of 2: 19 per process, trimmed to 9 whole windows of K = 2 an epoch.
    Validations every 5 steps (after steps 4 and 9, the second in epoch 1, where an untrimmed epoch's short window
    would have put it inside a window) and after the last step (10), each named as the trace numbers it."""
    out = tmp_path / "run"
    command = [
        sys.executable, str(EXAMPLES / "train_masked_lm.py"), "--accelerator=cpu", "--devices=2", "--accumulate=2",
        "--max-steps=11", "--eval-every=5", "--micro-batch-size=2", "--limit=80", f"--out={out}",
    ]  # fmt: skip
    done = run_bounded(command, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"written to {out}" in done.stdout

    with (out / "trace.csv").open(newline="") as file:
        trace = list(csv.DictReader(file))
    assert [int(row["step"]) for row in trace] == list(range(11))
    assert all(row["world_size"] == "2" and float(row["global_count"]) > 0 for row in trace)
    # piped, not a terminal: one line per evaluation with the exact loss and N of its last step
    printed = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in printed] == ["step 4", "step 9", "step 10"], done.stdout
    for line, row in zip(printed, (trace[4], trace[9], trace[10]), strict=True):
        assert f"exact train loss {float(row['loss']):.4f} (N = {float(row['global_count']):.0f})" in line, line
    with (out / "csv" / "metrics.csv").open(newline="") as file:
        validations = {int(row["step"]): float(row["val_loss"]) for row in csv.DictReader(file) if row["val_loss"]}
    assert sorted(validations) == [4, 9, 10]
    best = min(validations, key=validations.__getitem__)
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["last.ckpt", f"step={best}.ckpt"]
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 11
    assert "inside_window" not in checkpoint["token_mean"]


def test_template_bar_totals() -> None:
    """76 pairs on 2 processes in micro-batches of 2: 19 per process, trimmed to 9 windows of K = 2 an epoch."""
    assert train_masked_lm.batches_per_epoch(76, 2, 2, 2) == 18
    assert train_masked_lm.batches_per_epoch(76, 2, 2, 40) == 19  # fewer than K: one short window, kept
    assert train_masked_lm.epochs_for(4, 76, 2, 2, 2) == 1
    assert train_masked_lm.epochs_for(9, 76, 2, 2, 2) == 1
    assert train_masked_lm.epochs_for(10, 76, 2, 2, 2) == 2
    assert train_masked_lm.epochs_for(300, 6356, 1, 8, 4) == 2  # the defaults on one process: 198 steps an epoch


def test_template_accepts_a_gpu() -> None:
    args = train_masked_lm.parse_args(["--accelerator", "gpu", "--devices", "8", "--precision", "bf16-mixed"])
    assert (args.accelerator, args.devices, args.precision) == ("gpu", "8", "bf16-mixed")


FABRIC_RUN = {"devices": 2, "accumulate": 2, "max_steps": 4, "eval_every": 2, "micro_batch_size": 2, "limit": 80}


def fabric_template_counts(devices: int, accumulate: int, max_steps: int, micro_batch_size: int, limit: int,
                           seed: int = 0, **_: object) -> list[float]:
    """N of each step, recounted: the batches Fabric's DistributedSampler gives each rank (shuffled with the seed
    that `fabric.seed_everything` sets, a new order each pass), K per rank and window, a short last window."""
    train_pairs, _ = stdlib_corpus.train_val_split(stdlib_corpus.load_pairs(limit=limit), seed=seed)
    dataset = stdlib_corpus.PairDataset(train_pairs)
    counts: list[float] = []
    for epoch in itertools.count():
        ranks = []
        for rank in range(devices):
            sampler: DistributedSampler[int] = DistributedSampler(dataset, devices, rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            loader = DataLoader(dataset, micro_batch_size, sampler=sampler, collate_fn=stdlib_corpus.collate)
            ranks.append([int((batch["labels"] != -100).sum()) for batch in loader])
        for start in range(0, len(ranks[0]), accumulate):
            counts.append(float(sum(sum(rank[start : start + accumulate]) for rank in ranks)))
        if len(counts) >= max_steps:
            return counts[:max_steps]
    raise AssertionError("unreachable")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.script  # a user's script end to end: `make test-scripts`, which CI runs beside `make test`
@pytest.mark.parametrize(
    ("strategy", "mode"),
    [
        ("ddp", "lookahead"),
        pytest.param("fsdp", "deferred", marks=pytest.mark.skipif(not FSDP2_RUNS_ON_CPU, reason=NO_FSDP2_ON_CPU)),
    ],
)
def test_fabric_template_trains_on_two_cpu_processes(tmp_path: Path, strategy: str, mode: str) -> None:
    """Fabric's subprocess launcher re-runs the script (ModelParallelStrategy has no other); every step's N in the
    trace is the recount of the batches Fabric's sampler gave the two ranks."""
    out = tmp_path / "run"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in FABRIC_RUN.items()]
    command = [
        sys.executable, str(EXAMPLES / "fabric_masked_lm.py"), "--accelerator=cpu", f"--strategy={strategy}",
        f"--mode={mode}", *flags, f"--out={out}",
    ]  # fmt: skip
    try:
        run_job([command], tmp_path / "logs", timeout=180)
    except subprocess.CalledProcessError as error:
        pytest.fail(f"{error}\n{error.output[-4000:]}")
    log = (tmp_path / "logs" / "job0.log").read_text()
    assert f"written to {out}" in log

    with (out / "trace.csv").open(newline="") as file:
        trace = list(csv.DictReader(file))
    assert [int(row["step"]) for row in trace] == [0, 1, 2, 3]
    assert all(row["world_size"] == "2" and row["window_length"] == "2" for row in trace)
    assert [float(row["global_count"]) for row in trace] == fabric_template_counts(**FABRIC_RUN)
    assert all(math.isfinite(float(row[column])) for row in trace for column in ("loss", "grad_norm", "param_norm"))
    for step, row in ((1, trace[1]), (3, trace[3])):  # the printout: the exact loss and N of the evaluated step
        assert f"step {step}: exact train loss {float(row['loss']):.4f} (N = {float(row['global_count']):.0f})" in log
    with (out / "csv" / "metrics.csv").open(newline="") as file:
        metrics = list(csv.DictReader(file))
    val_losses = [float(row["val_loss"]) for row in metrics if row.get("val_loss")]
    assert len(val_losses) == 2 and all(math.isfinite(loss) for loss in val_losses)  # at steps 2 and 4
    # ddp: one file from rank 0; fsdp: a folder of model and optimizer shards, the rest in its meta.pt
    saved = out / "last.ckpt" if strategy == "ddp" else out / "last.ckpt" / "meta.pt"
    checkpoint = torch.load(saved, map_location="cpu", weights_only=False)
    assert checkpoint["step"] == 4 and checkpoint["accumulator"]["windows"] == 4
    if strategy == "ddp":
        assert {"model", "optimizer"} <= set(checkpoint)
    else:
        assert len(list(saved.parent.glob("*.distcp"))) == 2  # one shard file per rank


def test_fabric_template_accepts_a_gpu() -> None:
    args = fabric_masked_lm.parse_args(["--accelerator", "gpu", "--devices", "8", "--strategy", "fsdp"])
    assert (args.accelerator, args.devices, args.strategy) == ("gpu", "8", "fsdp")


@pytest.mark.parametrize("script", [train_masked_lm, fabric_masked_lm, masked_lm])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--accumulate", "0"], "argument --accumulate: must be at least 1, got 0"),
        (["--accumulate", "-2"], "argument --accumulate: must be at least 1, got -2"),
        (["--micro-batch-size", "0"], "argument --micro-batch-size: must be at least 1, got 0"),
        (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
        (["--devices", "0"], "argument --devices: must be"),
    ],
)
def test_parsers_refuse_non_positive_counts(
    script: object, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any process starts (the Trainer would take `accumulate_grad_batches=0` and fail in its loop)."""
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)  # type: ignore[attr-defined]
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("script", [train_masked_lm, fabric_masked_lm])
@pytest.mark.parametrize("option", ["--max-steps", "--eval-every"])
def test_template_parsers_refuse_non_positive_steps(
    script: object, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        script.parse_args([option, "0"])  # type: ignore[attr-defined]
    assert f"argument {option}: must be at least 1, got 0" in capsys.readouterr().err


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
@pytest.mark.script  # `make test-scripts`; CI runs it beside `make test`
def test_demo_end_to_end(tmp_path: Path) -> None:
    """Two cuts of one global batch on 2 processes (P×K = 2×2; micro-batches of 2 samples, dealt at random or by
    length, so that from step 1 on they hold other samples in each): both token-mean runs stay on the reference, the
    plain runs leave it and each other."""
    out = tmp_path / "demo"
    command = [
        sys.executable, str(EXAMPLES / "masked_lm.py"), "--steps=3", "--micro-batch-size=2", "--limit=60",
        "--layouts", "2x2", "--cuts", "random", "length", f"--out={out}",
    ]  # fmt: skip
    done = run_bounded(command, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith(f"Run folder: {out}")
    # One line per run and the table: no progress bars, model summaries or Lightning banners from the sub-runs.
    assert len(done.stdout.splitlines()) <= 18, done.stdout
    names = ["reference", "token_mean-2x2", "token_mean-2x2-by-length", "plain-2x2", "plain-2x2-by-length"]
    started = [line.split()[:3] for line in done.stdout.splitlines() if line.startswith("run ")]
    assert started == [["run", f"{index}/5:", name] for index, name in enumerate(names, start=1)], done.stdout
    for noise in ("Epoch 0", "GPU available", "Initializing distributed", "Trainable params"):
        assert noise not in done.stdout + done.stderr

    summary = json.loads((out / "summary.json").read_text())
    losses, runs = summary["losses"], summary["runs"]
    assert len(losses["reference"]) == 3
    for name in names[1:3]:
        for step, (reference, loss) in enumerate(zip(losses["reference"], losses[name], strict=True)):
            assert abs(loss - reference) <= LOSS_RTOL * abs(reference), f"{name}, step {step}: {loss} vs {reference}"
        assert runs[name]["first_flagged_step"] is None
        assert [audit["passed"] for audit in runs[name]["audits"]] == [True], runs[name]["audits"]
        assert abs(runs[name]["val_loss"] - runs["reference"]["val_loss"]) <= LOSS_RTOL * runs["reference"]["val_loss"]
    for name in names[3:]:
        assert runs[name]["first_flagged_step"] is not None
        assert runs[name]["max_abs_loss_deviation"] > 100 * runs["token_mean-2x2"]["max_abs_loss_deviation"]
        assert [audit["passed"] for audit in runs[name]["audits"]] == [False], runs[name]["audits"]
    # plain DDP's objective depends on the cut: its two runs differ from each other, the token-mean runs do not
    plain_gap = abs(losses["plain-2x2"][-1] - losses["plain-2x2-by-length"][-1])
    assert plain_gap > 100 * abs(losses["token_mean-2x2"][-1] - losses["token_mean-2x2-by-length"][-1]), plain_gap
    assert "FLAGGED" in done.stdout and "the final train losses of the 2 layouts and cuts span" in done.stdout
    for name in names:  # the same held-out functions, with their names (--names is on by default): short targets
        assert math.isfinite(runs[name]["val_loss_short"]), runs[name]
        assert runs[name]["cut"] == (None if name == "reference" else "length" if "by-length" in name else "random")
    assert len({run["data_digest"] for run in runs.values()}) == 1

    assert (out / "layouts.png").stat().st_size > 0
    for name in names:
        with (out / name / "trace.csv").open(newline="") as file:
            assert len(list(csv.DictReader(file))) == 3
        assert (out / name / "csv" / "metrics.csv").stat().st_size > 0


def test_length_cut_deals_each_global_batch_sorted_by_length() -> None:
    """Every whole global batch of the reference, sorted by length and cut into micro-batches dealt round the ranks;
    the short last window of the epoch is left out on every rank alike."""
    pairs = [(f"def f{index:02d}():\n", "x" * ((index * 37) % 101 + 1)) for index in range(29)]
    dataset = stdlib_corpus.PairDataset(pairs, 64, 191)
    devices, accumulate, micro_batch_size = 2, 2, 2  # 15 samples per rank: 3 whole windows of 4, then 3
    reference = list(masked_lm.GlobalBatches(dataset, devices, accumulate, micro_batch_size, seed=3))
    ranks = [
        masked_lm.LengthGroupedBatches(dataset, devices, rank, accumulate, micro_batch_size, seed=3)
        for rank in range(devices)
    ]
    dealt = [list(rank) for rank in ranks]
    assert [len(batches) for batches in dealt] == [len(rank) for rank in ranks] == [6, 6]
    length = [dataset[index]["input_ids"].numel() for index in range(len(dataset))]
    for step in range(3):
        micro_batches = [dealt[j % devices][step * accumulate + j // devices] for j in range(devices * accumulate)]
        in_order = [index for batch in micro_batches for index in batch]
        assert sorted(in_order) == sorted(reference[step])
        assert [length[index] for index in in_order] == sorted((length[index] for index in in_order), reverse=True)


def test_name_pairs_ask_for_each_defined_function() -> None:
    pairs = [
        ("def add(a, b):\n", "    return a + b\n"),
        ("    async def fetch(self):\n", "    pass\n"),
        ("# not a definition\n", "x = 1\n"),
    ]
    assert masked_lm.name_pairs(pairs) == [
        (masked_lm.NAME_PROMPT + "    return a + b\n", "add"),
        (masked_lm.NAME_PROMPT + "    pass\n", "fetch"),
    ]


def test_demo_refuses_layouts_of_other_global_batches() -> None:
    dataset = cast(Dataset[int], list(range(64)))
    with pytest.raises(SystemExit, match="every layout must hold the same P×K micro-batches"):
        masked_lm.check_layouts(dataset, [(1, 8), (2, 2)], steps=2, micro_batch_size=2, seed=0)
    with pytest.raises(SystemExit, match="step 4 is past the first epoch's whole global batches"):
        masked_lm.check_layouts(dataset, [(1, 8), (2, 4)], steps=5, micro_batch_size=2, seed=0)
    masked_lm.check_layouts(dataset, [(1, 8), (2, 4), (4, 2)], steps=4, micro_batch_size=2, seed=0)
    # 58 samples: 3 whole global batches of 16, then 10, which the length cut would not deal
    with pytest.raises(SystemExit, match="step 3 is past the first epoch's whole global batches"):
        masked_lm.check_layouts(cast(Dataset[int], list(range(58))), [(2, 4)], steps=4, micro_batch_size=2, seed=0)
