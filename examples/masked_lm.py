"""One objective whatever the hardware: the template ``train_masked_lm.py`` on the same global batches, laid out
as P processes × K micro-batches in several ways (P × K = 1 × 8, 2 × 4, 4 × 2), with and without the strategy.

A prompt-masked LM should average its loss over the valid target tokens of each optimizer step. With DDP and
gradient accumulation, Lightning averages per-micro-batch means (÷K) and DDP averages per-rank gradients (÷P): the
objective then depends on how the global batch is cut into micro-batches, that is on the hardware, so moving a run
from 8 GPUs to 64 changes what it optimizes. This script trains the template's ``MaskedLM`` (its loaders included:
Lightning's own ``DistributedSampler``) on exactly the same global batches in the same order, from the same
initialization:

1. ``reference``: 1 process, no accumulation; each optimizer step sees its whole global batch at once: the P×K
   micro-batches that the P ranks' ``DistributedSampler`` deal out for that step, concatenated and re-padded
   (padding is masked, so the token mean is unchanged);
2. ``token_mean-PxK``: ``TokenMeanDDPStrategy`` on P processes with ``accumulate_grad_batches=K``, for each layout;
3. ``plain-PxK``: plain ``DDPStrategy``, the same layouts.

Every run records a ``DenominatorMonitor`` trace; the others are compared with the reference step by step (the
monitor flags the first step that leaves it) and audit their own gradients every ``AUDIT_EVERY`` steps. The script
prints one line per run and a table, and writes ``summary.json`` and ``layouts.png`` into one run folder,
``runs/masked_lm-<timestamp>/``, whose path it prints last. Only two things differ from the template: SGD instead
of AdamW (see ``LEARNING_RATE``) and, for the reference, a loader of whole global batches.

Commands, from the repository root (``make demo`` creates ``.venv`` first if needed):

    make demo                                                          # the seven runs: ~2 minutes on 2 CPU cores
    .venv/bin/python examples/masked_lm.py --steps 10 --limit 1000     # the same, smaller
    .venv/bin/python examples/masked_lm.py --layouts 2x4 8x1           # other layouts of one global batch
    .venv/bin/python examples/masked_lm.py --run reference --out runs/mine   # one run, in a single process
    .venv/bin/python examples/masked_lm.py --run plain --devices 2 --accumulate 4 --out runs/mine
    .venv/bin/torchrun --nproc_per_node=2 examples/masked_lm.py -- --run token_mean --accumulate 4 --out runs/mine
    .venv/bin/python examples/masked_lm.py --data my_pairs.jsonl       # your own {"prompt": ..., "response": ...} lines

The ``--`` after the script keeps torchrun from reading ``--run`` as an abbreviation of its own ``--run-path``.
A single ``--run`` writes ``OUT/<run>-<P>x<K>/`` (``OUT/reference/`` for the reference; ``OUT`` defaults to
``runs/masked_lm``) and, when ``OUT/reference/`` holds a reference recorded on the same global batches, is compared
with it. ``--precision 64-true`` makes the token-mean runs match the reference to ~1e-15 instead of ~1e-7, for
about 1.5× the training time. The comparison runs on the CPU, where its tolerances were measured.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

# The examples are scripts beside each other, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import positive
from stdlib_corpus import PairDataset, collate, load_pairs, train_val_split
from tiny_lm import LMConfig, TinyLM
from train_masked_lm import Batch, MaskedLM

from token_mean import TokenMeanDDPStrategy
from token_mean.callback import DenominatorMonitor

RUNS = ("reference", "token_mean", "plain")
LAYOUTS = ((1, 8), (2, 4), (4, 2))  # (P, K): the same global batch of 8 micro-batches, cut three ways
# SGD with momentum, a fixed learning rate and no clipping: the update is linear in the gradient, so float32
# round-off stays round-off. AdamW (the template's) learns faster but divides by sqrt(v): where a gradient entry is ~0
# its sign decides a full-lr step, and round-off flips such signs; a float32 replay then drifted by 1e-5 within 20
# steps. Clipping at a threshold the norm crosses back and forth amplified round-off the same way. A larger learning
# rate sharpens the loss surface sooner, after which round-off grows by orders of magnitude within ten steps: at 0.03
# the gradient norm spiked from ~1 to 8.7 around step 80 of the default run and the token-mean run's gradient norm
# came within 1e-4 of the reference's (the monitor's tolerance); at 0.1 the loss itself spikes.
LEARNING_RATE = 0.02
MOMENTUM = 0.9
# Shorter than the corpus' own caps (256 and 383 bytes): a batch costs in proportion to its longest sample (and
# attention to its square), and the reference pads each step's whole global batch to one length. Each sample still
# has 2 to 256 target tokens, as its function's body is long, so micro-batches stay ragged.
PROMPT_BYTES = 128
RESPONSE_BYTES = 255
VAL_PAIRS = 128  # the first 128 of the held-out split: ~1 s of forward passes per run
# The monitor compares N exactly, and loss, grad_norm and param_norm within ATOL + RTOL·|reference|.
# In float32 the token-mean run adds the same per-token terms in another order than the reference's single batch
# (per micro-batch, per rank, then gloo's all-reduce). Measured over the 120 steps of the default settings, seeds 0
# and 1: at most 2e-7 relative on the loss, 3e-8 on the parameter norm and 7e-6 on the gradient norm, the most
# sensitive (the loss surface sharpens as training goes, so a 1e-8 difference in the parameters shows as 1e-6 in the
# gradient). 1e-4 (the monitor's default) leaves a 15× margin, while plain DDP's gradient norm is off by ~4e-2 at
# step 0.
RTOL = 1e-4
ATOL = 1e-6
# The objective audit (docs/audit.md) of the DDP runs: the first window and every AUDIT_EVERY-th replayed on one
# module and compared with the gradient the optimizer is about to apply; no reference run needed.
AUDIT_EVERY = 20


# ----------------------------------------------------------------------------------------------------------------
# what the comparison changes in the template: the optimizer, and the reference's loader
# ----------------------------------------------------------------------------------------------------------------


class GlobalBatches(Sampler[list[int]]):
    """The reference's batches: each optimizer step's P×K micro-batches of a DDP run as one batch, in their order.

    Rank r of a DDP run draws from Lightning's ``DistributedSampler(train_set, P, r, shuffle=True, seed)`` in
    micro-batches of B, K of them per optimizer step, so step w of an epoch trains on positions [wKB, (w+1)KB) of
    every rank's order (fewer at the end of an epoch, where Lightning steps on a short window too).
    """

    def __init__(self, dataset: Dataset[Any], devices: int, accumulate: int, micro_batch_size: int, seed: int) -> None:
        self.ranks: list[DistributedSampler[int]] = [
            DistributedSampler(dataset, devices, rank, shuffle=True, seed=seed) for rank in range(devices)
        ]
        self.window = accumulate * micro_batch_size
        self.sampler = self  # Lightning calls `set_epoch` on `batch_sampler.sampler` at every epoch start

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.ranks:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.ranks[0]) / self.window)

    def __iter__(self) -> Iterator[list[int]]:
        orders = [list(sampler) for sampler in self.ranks]
        for start in range(0, len(orders[0]), self.window):
            yield [index for order in orders for index in order[start : start + self.window]]


class Comparison(MaskedLM):
    """The template's module, trained with SGD; with ``global_batches``, on whole global batches (the reference)."""

    def __init__(
        self,
        train_set: PairDataset,
        val_set: PairDataset,
        micro_batch_size: int,
        seed: int,
        global_batches: GlobalBatches | None = None,
    ) -> None:
        super().__init__(train_set, val_set, micro_batch_size, seed)
        self.global_batches = global_batches

    def train_dataloader(self) -> DataLoader[Batch]:
        if self.global_batches is None:
            return super().train_dataloader()
        return DataLoader(self.train_set, batch_sampler=self.global_batches, collate_fn=collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)


# ----------------------------------------------------------------------------------------------------------------
# one run: one Trainer, in its own process(es)
# ----------------------------------------------------------------------------------------------------------------


def load_data(args: argparse.Namespace) -> tuple[list[tuple[str, str]], PairDataset, PairDataset]:
    pairs = load_pairs(limit=args.limit, data=args.data)
    train_pairs, val_pairs = train_val_split(pairs, seed=args.seed)
    val_pairs = val_pairs[:VAL_PAIRS]
    if len(val_pairs) < args.devices:
        raise ValueError(f"{len(val_pairs)} validation pair(s) for {args.devices} processes: pass a larger `--limit`.")
    if not train_pairs:
        raise ValueError("The training split is empty: pass a larger `--limit` or a `--data` file with more pairs.")
    return (
        pairs,
        PairDataset(train_pairs, PROMPT_BYTES, RESPONSE_BYTES),
        PairDataset(val_pairs, PROMPT_BYTES, RESPONSE_BYTES),
    )


def data_digest(pairs: Sequence[tuple[str, str]], args: argparse.Namespace) -> str:
    """The data and everything that deals it into global batches (P×K, not P and K apart: every layout of one
    product deals the same global batches, :func:`check_layouts`): equal digests mean identical global batches."""
    layout = [args.steps, args.devices * args.accumulate, args.micro_batch_size, args.seed]
    return hashlib.sha256(json.dumps([pairs, layout]).encode()).hexdigest()[:16]


def check_layouts(dataset: Dataset[Any], layouts: Sequence[tuple[int, int]], steps: int, micro_batch_size: int,
                  seed: int) -> None:
    """Refuse layouts whose first ``steps`` global batches differ: P×K must be one number, and the steps must stay
    within an epoch's whole global batches (where the samplers pad their ranks, the layouts repeat other samples)."""
    if len({devices * accumulate for devices, accumulate in layouts}) != 1:
        raise SystemExit(f"--layouts {format_layouts(layouts)}: every layout must hold the same P×K micro-batches, so"
                         " that they train the same global batches.")
    batches = [list(GlobalBatches(dataset, devices, accumulate, micro_batch_size, seed)) for devices, accumulate
               in layouts]
    for step in range(steps):
        epoch, index = divmod(step, len(batches[0]))
        if epoch or any(sorted(run[index]) != sorted(batches[0][index]) for run in batches):
            raise SystemExit(f"--steps {steps}: step {step} is past the first epoch's whole global batches, where the"
                             " layouts' samplers pad differently. Pass fewer --steps or a larger --limit.")


def format_layouts(layouts: Sequence[tuple[int, int]]) -> str:
    return " ".join(f"{devices}x{accumulate}" for devices, accumulate in layouts)


def run_name(run: str, devices: int, accumulate: int) -> str:
    return run if run == "reference" else f"{run}-{devices}x{accumulate}"


def train_one(args: argparse.Namespace) -> None:
    """``--run NAME``: train one run with its own Trainer, writing ``OUT/NAME-PxK/`` (the reference:
    ``OUT/reference``)."""
    started = time.perf_counter()
    # The demo prints one line per run: Lightning's banners (devices, distributed set-up, tips) stay out of it.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Tokenizing a pair takes microseconds, so loader workers would only add process start-up.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    # Lightning 2.6 calling an API torch 2.13 deprecated, once per process: nothing a user of this script can act on.
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
    pl.seed_everything(args.seed, verbose=False)  # the seed of Lightning's DistributedSampler in the DDP runs
    out = Path(args.out or "runs/masked_lm")
    run_dir = out / run_name(args.run, args.devices, args.accumulate)
    pairs, train_set, val_set = load_data(args)
    digest = data_digest(pairs, args)

    reference_trace = out / "reference" / "trace.csv"
    reference_result = out / "reference" / "result.json"
    if args.run == "reference" or not reference_trace.is_file():
        reference = None
    else:
        if not reference_result.is_file():
            raise SystemExit(f"{reference_trace} has no result.json beside it: the reference run did not finish.")
        recorded = json.loads(reference_result.read_text())
        if recorded.get("data_digest") != digest:
            raise SystemExit(
                f"{reference_trace} was recorded on other global batches (data digest {recorded.get('data_digest')},"
                f" this run's is {digest}). Use the same --data, --limit, --steps, --devices × --accumulate,"
                " --micro-batch-size and --seed, or another --out."
            )
        reference = reference_trace

    strategy: Strategy | str
    global_batches = None
    if args.run == "reference":
        strategy, devices, accumulate = "auto", 1, 1
        global_batches = GlobalBatches(train_set, args.devices, args.accumulate, args.micro_batch_size, args.seed)
    elif args.run == "token_mean":
        # The default launcher (popen) re-runs this command line in the other ranks; under torchrun none is needed.
        strategy, devices, accumulate = TokenMeanDDPStrategy(mode=args.mode), args.devices, args.accumulate
    else:
        strategy, devices, accumulate = DDPStrategy(), args.devices, args.accumulate

    # Every run records its own trace (for the table and the plot); the DDP runs also compare with the reference,
    # and audit their own gradients against the token-mean objective.
    monitor = DenominatorMonitor(
        record=run_dir / "trace.csv", reference=reference, rtol=RTOL, atol=ATOL, on_divergence="log",
        audit_every=None if args.run == "reference" else AUDIT_EVERY, on_audit_failure="log",
    )
    loggers: list[Logger] = [CSVLogger(run_dir, name="", version="csv")]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(TensorBoardLogger(run_dir, name="", version="tensorboard"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        precision=args.precision,
        max_steps=args.steps,
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # CSV rows are cheap; the monitor logs once per optimizer step
        callbacks=[monitor],
        logger=loggers,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,  # a bar redrawn per batch is hundreds of lines in a log; the parent prints one
    )
    module = Comparison(train_set, val_set, args.micro_batch_size, args.seed, global_batches=global_batches)
    trainer.fit(module)
    # Once, after the last step: the same held-out pairs for every run, each on exactly one rank.
    [metrics] = trainer.validate(module, verbose=False)

    if trainer.is_global_zero:
        divergence = monitor.first_divergence
        result = {
            "run": args.run,
            "world_size": trainer.world_size,
            "accumulate_grad_batches": accumulate,
            "strategy": type(trainer.strategy).__name__,
            "val_loss": metrics["val_loss"],
            "compared_with": None if reference is None else str(reference),
            "first_flagged_step": None if divergence is None else divergence.step,
            "first_flagged_quantity": None if divergence is None else divergence.quantity,
            "first_flagged_message": None if divergence is None else divergence.message,
            "audits": [audit.__dict__ for audit in monitor.audits],
            "data_digest": digest,
            "parameters": sum(p.numel() for p in module.model.parameters()),
            "run_seconds": time.perf_counter() - started,  # from data loading to the end of validation, on rank 0
        }
        (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# the demo: the reference and every layout with and without the strategy, a table and a plot
# ----------------------------------------------------------------------------------------------------------------


def read_trace_column(path: Path, column: str) -> dict[int, float]:
    """One column of a ``DenominatorMonitor`` trace by optimizer step; empty cells (the loss when N = 0) left out."""
    with path.open(newline="") as file:
        return {int(row["step"]): float(row[column]) for row in csv.DictReader(file) if row[column]}


def run_all(args: argparse.Namespace) -> None:
    """The demo: every run one after the other, each in its own process(es), then the table and the plot."""
    layouts: list[tuple[int, int]] = args.layouts
    out = Path(args.out or f"runs/masked_lm-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    # Read the corpus once (a few seconds for the whole standard library) and hand the same file to every run.
    pairs = load_pairs(limit=args.limit, data=args.data)
    corpus = out / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8") as file:
        for prompt, response in pairs:
            file.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    train_pairs, _ = train_val_split(pairs, seed=args.seed)
    check_layouts(PairDataset(train_pairs, PROMPT_BYTES, RESPONSE_BYTES), layouts, args.steps, args.micro_batch_size,
                  args.seed)
    micro_batches = layouts[0][0] * layouts[0][1]
    parameters = sum(p.numel() for p in TinyLM(LMConfig()).parameters())
    print(
        f"{len(pairs)} prompt/response pairs from {args.data or 'the standard library'} ({len(train_pairs)} to train"
        f" on); TinyLM with {parameters:,} parameters, {args.precision}; {args.steps} optimizer steps, each on the"
        f" same global batch of {micro_batches} micro-batches × {args.micro_batch_size} samples, laid out as P×K ="
        f" {format_layouts(layouts).replace(' ', ', ')}."
    )
    common = [f"--steps={args.steps}", f"--mode={args.mode}", f"--micro-batch-size={args.micro_batch_size}",
              f"--seed={args.seed}", f"--precision={args.precision}", f"--data={corpus}", f"--out={out}"]
    plan = [("reference", *layouts[0])] + [(run, *layout) for run in RUNS[1:] for layout in layouts]
    walls: dict[str, float] = {}
    for index, (run, devices, accumulate) in enumerate(plan, start=1):
        name = run_name(run, devices, accumulate)
        what = {"reference": "1 process, each step's global batch at once",
                "token_mean": f"TokenMeanDDPStrategy(mode={args.mode!r}), P={devices}, K={accumulate}",
                "plain": f"DDPStrategy, P={devices}, K={accumulate}"}[run]
        print(f"run {index}/{len(plan)}: {name:<16} {what} ...", end="", flush=True)
        started = time.perf_counter()
        # A process per run: Lightning's launcher re-executes the command line in every rank it starts, so a script
        # that trained the runs in sequence would have its second rank redo the reference.
        subprocess.run([sys.executable, __file__, f"--run={run}", f"--devices={devices}",
                        f"--accumulate={accumulate}", *common], check=True)
        walls[name] = time.perf_counter() - started
        print(f" {walls[name]:.0f} s", flush=True)

    names = list(walls)
    results = {name: json.loads((out / name / "result.json").read_text()) for name in names}
    if len({result["data_digest"] for result in results.values()}) != 1:
        raise RuntimeError(f"The runs trained on different global batches: {results}. This is a bug in the example.")
    losses = {name: read_trace_column(out / name / "trace.csv", "loss") for name in names}
    steps = sorted(losses["reference"])
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        deviations = [abs(losses[name][step] - losses["reference"][step]) for step in steps]
        rows[name] = {
            **results[name],
            "final_train_loss": losses[name][steps[-1]],
            "max_abs_loss_deviation": max(deviations),
            "max_rel_loss_deviation": max(
                deviation / abs(losses["reference"][step]) for deviation, step in zip(deviations, steps, strict=True)
            ),
            "wall_seconds": walls[name],  # the whole process: imports, data, launching ranks, training, validation
        }

    print("\n" + format_table(rows))
    for run in RUNS[1:]:
        finals = [rows[run_name(run, *layout)]["final_train_loss"] for layout in layouts]
        print(f"{run:>10}: the final train losses of the {len(layouts)} layouts span {max(finals) - min(finals):.2e}")
    summary = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {name: value for name, value in vars(args).items() if name != "run"},
        "model": {"parameters": parameters, "prompt_bytes": PROMPT_BYTES, "response_bytes": RESPONSE_BYTES},
        "optimizer": {"name": "SGD", "lr": LEARNING_RATE, "momentum": MOMENTUM},
        "monitor_tolerance": {"rtol": RTOL, "atol": ATOL},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
        "runs": rows,
        "steps": steps,
        "losses": {name: [losses[name][step] for step in steps] for name in names},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(out / "layouts.png", steps, losses, rows, args)
    print(f"\nRun folder: {out}")


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    header = ("run", "P×K", "train loss", "val loss", "max |Δ loss| vs ref", "first flagged step", "audit (step 0)",
              "wall s")
    lines = [header]
    for name, row in rows.items():
        step, quantity = row["first_flagged_step"], row["first_flagged_quantity"]
        compared = name != "reference"
        lines.append((
            row["run"],
            f"{row['world_size']}×{row['accumulate_grad_batches']}" if compared else "1, whole",
            f"{row['final_train_loss']:.4f}",
            f"{row['val_loss']:.4f}",
            f"{row['max_abs_loss_deviation']:.2e}" if compared else "—",
            ("none" if step is None else f"{step} ({quantity})") if compared else "—",
            _first_audit(row["audits"]) if compared else "—",
            f"{row['wall_seconds']:.0f}",
        ))
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in lines)


def _first_audit(audits: list[dict[str, Any]]) -> str:
    if not audits or audits[0]["error"] is None:
        return "none"
    first = audits[0]
    return f"{first['error']:.1e} {'ok' if first['passed'] else 'FLAGGED'}"


def plot(
    path: Path,
    steps: list[int],
    losses: dict[str, dict[int, float]],
    rows: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> None:
    """Top: every run's loss over the last steps; bottom: |loss − reference loss| per step, log scale."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), height_ratios=(3, 2))
    last = steps[-min(len(steps), 20):]
    shades = {"token_mean": plt.get_cmap("Blues"), "plain": plt.get_cmap("Reds")}
    layouts = [name for name in rows if name != "reference"]
    for name in rows:
        row = rows[name]
        if name == "reference":
            label, style = "reference: 1 process, whole global batch", {"color": "black", "linewidth": 4, "alpha": 0.3}
        else:
            peers = [other for other in layouts if rows[other]["run"] == row["run"]]
            shade = shades[row["run"]](0.45 + 0.45 * peers.index(name) / max(len(peers) - 1, 1))
            strategy = "TokenMeanDDPStrategy" if row["run"] == "token_mean" else "plain DDPStrategy"
            label = f"{strategy}, P×K = {row['world_size']}×{row['accumulate_grad_batches']}"
            style = {"color": shade, "linewidth": 1.3, "linestyle": "--" if row["run"] == "token_mean" else "-"}
        top.plot(last, [losses[name][step] for step in last], label=label, **style)
        if name != "reference":
            # log scale: a step that matches exactly (0) is left out rather than drawn at an arbitrary floor
            deviation = [abs(losses[name][step] - losses["reference"][step]) or math.nan for step in steps]
            bottom.plot(steps, deviation, **(style | {"linestyle": "-"}))
    top.set_ylabel("train loss: token mean of the step")
    top.set_xlabel(f"optimizer step (the last {len(last)})")
    top.set_title(
        f"The same global batches and initialization, cut into P processes × K micro-batches; {args.precision}, SGD",
        fontsize="medium",
    )
    top.legend(loc="upper right", fontsize="small")
    tolerance = [ATOL + RTOL * abs(losses["reference"][step]) for step in steps]
    bottom.plot(steps, tolerance, color="grey", linestyle=":", label="the monitor's tolerance")
    bottom.set_yscale("log")
    bottom.set_ylabel("|loss − reference loss|")
    bottom.set_xlabel("optimizer step")
    bottom.legend(loc="lower right", fontsize="small")
    bottom.set_title("token-mean runs: float32 round-off from the reference, whatever the layout; plain DDP: another"
                     " objective for each layout", fontsize="small")
    for axes in (top, bottom):
        axes.xaxis.get_major_locator().set_params(integer=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ----------------------------------------------------------------------------------------------------------------


def layout(text: str) -> tuple[int, int]:
    devices, _, accumulate = text.lower().partition("x")
    if not (devices.isdigit() and accumulate.isdigit() and int(devices) > 0 and int(accumulate) > 0):
        raise argparse.ArgumentTypeError(f"must be PxK with positive P and K (e.g. 2x4), got {text!r}")
    return int(devices), int(accumulate)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--run", choices=("all", *RUNS), default="all", help="the demo (default), or one run alone")
    parser.add_argument("--layouts", type=layout, nargs="+", default=list(LAYOUTS),
                        help="the demo's P×K layouts of one global batch (default: 1x8 2x4 4x2)")
    parser.add_argument("--steps", type=positive, default=40, help="optimizer steps of every run (default: 40)")
    parser.add_argument("--devices", type=positive, default=2, help="--run: P, the DDP processes (default: 2)")
    parser.add_argument("--accumulate", type=positive, default=4, help="--run: K, micro-batches per step and process")
    parser.add_argument("--mode", choices=("lookahead", "deferred"), default="lookahead", help="of the strategy")
    parser.add_argument("--micro-batch-size", type=positive, default=2, help="samples per micro-batch (default: 2)")
    parser.add_argument("--data", help='JSON Lines of {"prompt", "response"} pairs (default: the standard library)')
    parser.add_argument("--limit", type=positive, help="use only the first LIMIT pairs (default: all)")
    parser.add_argument("--out", help="run folder (default: runs/masked_lm-<timestamp>; runs/masked_lm with --run)")
    parser.add_argument("--seed", type=int, default=0, help="initialization, split and order (default: 0)")
    parser.add_argument("--precision", choices=("32-true", "64-true"), default="32-true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.run == "all":
        run_all(arguments)
    else:
        train_one(arguments)
