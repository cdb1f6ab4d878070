"""Reference vs token-mean vs plain DDP: the template ``train_masked_lm.py`` trained three ways on the same batches.

A prompt-masked LM should average its loss over the valid target tokens of each optimizer step. With DDP and
gradient accumulation, Lightning averages per-micro-batch means (÷K) and DDP averages per-rank gradients (÷P), so a
token in a micro-batch with few targets weighs more than one in a long micro-batch. This script trains the
template's ``MaskedLM`` (its loaders included: Lightning's own ``DistributedSampler`` for training) three times, on
exactly the same global batches in the same order, from the same initialization:

1. ``reference``: 1 process, no accumulation; each optimizer step sees its whole global batch at once: the P×K
   micro-batches that the P ranks' ``DistributedSampler`` deal out for that step, concatenated and re-padded
   (padding is masked, so the token mean is unchanged);
2. ``token_mean``: ``TokenMeanDDPStrategy`` on P processes with ``accumulate_grad_batches=K``;
3. ``naive``: plain ``DDPStrategy``, same layout.

Run (1) records a ``DenominatorMonitor`` trace; runs (2) and (3) are compared with it step by step, and the monitor
flags the first step that leaves the reference. The script prints one line per run and a table, and writes
``summary.json`` and ``loss_curves.png`` into one run folder, ``runs/masked_lm-<timestamp>/``, whose path it prints
last. Only two things differ from the template: SGD instead of AdamW (see ``LEARNING_RATE``) and, for the
reference, a loader of whole global batches.

Commands, from the repository root (``make demo`` creates ``.venv`` first if needed):

    make demo                                                          # the three runs: ~2 minutes on 2 CPU cores
    .venv/bin/python examples/masked_lm.py --steps 20 --limit 1000     # the same, smaller: under a minute
    .venv/bin/python examples/masked_lm.py --run reference --out runs/mine   # one run, in a single process
    .venv/bin/python examples/masked_lm.py --run naive --out runs/mine       # 2 processes, started by Lightning
    .venv/bin/torchrun --nproc_per_node=2 examples/masked_lm.py -- --run token_mean --out runs/mine
    .venv/bin/python examples/masked_lm.py --data my_pairs.jsonl       # your own {"prompt": ..., "response": ...} lines

The ``--`` after the script keeps torchrun from reading ``--run`` as an abbreviation of its own ``--run-path``.
A single ``--run`` writes ``OUT/<run>/`` (``OUT`` defaults to ``runs/masked_lm``) and, when ``OUT/reference/`` holds
a reference recorded with the same data flags, is compared with it. ``--devices`` is P in every run (the reference
still runs in one process, on the global batches of the P×K layout); under torchrun, ``--nproc_per_node`` must
equal it. ``--precision 64-true`` makes the token-mean run match the reference to ~1e-15 instead of ~1e-7, for
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

RUNS = ("reference", "token_mean", "naive")
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
AUDIT_EVERY = 10


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
    """The data and everything that deals it into global batches: equal digests mean identical global batches."""
    layout = [args.steps, args.devices, args.accumulate, args.micro_batch_size, args.seed]
    return hashlib.sha256(json.dumps([pairs, layout]).encode()).hexdigest()[:16]


def train_one(args: argparse.Namespace) -> None:
    """``--run NAME``: train one of the three runs with its own Trainer, writing ``OUT/NAME/``."""
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
    run_dir = out / args.run
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
                f" this run's is {digest}). Use the same --data, --limit, --steps, --devices, --accumulate,"
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
# the demo: three runs, a table and a plot
# ----------------------------------------------------------------------------------------------------------------


def read_trace_column(path: Path, column: str) -> dict[int, float]:
    """One column of a ``DenominatorMonitor`` trace by optimizer step; empty cells (the loss when N = 0) left out."""
    with path.open(newline="") as file:
        return {int(row["step"]): float(row[column]) for row in csv.DictReader(file) if row[column]}


def run_all(args: argparse.Namespace) -> None:
    """The demo: the three runs one after the other, each in its own process, then the table and the plot."""
    out = Path(args.out or f"runs/masked_lm-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    # Read the corpus once (a few seconds for the whole standard library) and hand the same file to every run.
    pairs = load_pairs(limit=args.limit, data=args.data)
    corpus = out / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8") as file:
        for prompt, response in pairs:
            file.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    train_pairs, _ = train_val_split(pairs, seed=args.seed)
    per_step = args.devices * args.accumulate * args.micro_batch_size
    parameters = sum(p.numel() for p in TinyLM(LMConfig()).parameters())
    print(
        f"{len(pairs)} prompt/response pairs from {args.data or 'the standard library'} ({len(train_pairs)} to train"
        f" on); TinyLM with {parameters:,} parameters, {args.precision}; {args.steps} optimizer steps of"
        f" {per_step} samples (P={args.devices} processes × K={args.accumulate} micro-batches ×"
        f" {args.micro_batch_size} samples)."
    )

    settings = [
        f"--steps={args.steps}",
        f"--devices={args.devices}",
        f"--accumulate={args.accumulate}",
        f"--mode={args.mode}",
        f"--micro-batch-size={args.micro_batch_size}",
        f"--seed={args.seed}",
        f"--precision={args.precision}",
        f"--data={corpus}",
        f"--out={out}",
    ]
    layouts = {
        "reference": "1 process, each step's global batch at once",
        "token_mean": f"TokenMeanDDPStrategy(mode={args.mode!r}), P={args.devices}, K={args.accumulate}",
        "naive": f"DDPStrategy, P={args.devices}, K={args.accumulate}",
    }
    walls: dict[str, float] = {}
    for index, run in enumerate(RUNS, start=1):
        print(f"run {index}/{len(RUNS)}: {run:<10} {layouts[run]} ...", end="", flush=True)
        started = time.perf_counter()
        # A process per run: Lightning's launcher re-executes the command line in every rank it starts, so a script
        # that trained the three runs in sequence would have its second rank redo the reference.
        subprocess.run([sys.executable, __file__, f"--run={run}", *settings], check=True)
        walls[run] = time.perf_counter() - started
        print(f" {walls[run]:.0f} s", flush=True)

    results = {run: json.loads((out / run / "result.json").read_text()) for run in RUNS}
    if len({result["data_digest"] for result in results.values()}) != 1:
        raise RuntimeError(f"The runs trained on different global batches: {results}. This is a bug in the example.")
    losses = {run: read_trace_column(out / run / "trace.csv", "loss") for run in RUNS}
    steps = sorted(losses["reference"])
    rows: dict[str, dict[str, Any]] = {}
    for run in RUNS:
        deviations = [abs(losses[run][step] - losses["reference"][step]) for step in steps]
        weight_errors = list(read_trace_column(out / run / "trace.csv", "naive_weight_error").values())
        rows[run] = {
            **results[run],
            "final_train_loss": losses[run][steps[-1]],
            "max_abs_loss_deviation": max(deviations),
            "max_rel_loss_deviation": max(
                deviation / abs(losses["reference"][step]) for deviation, step in zip(deviations, steps, strict=True)
            ),
            "mean_naive_weight_error": sum(weight_errors) / len(weight_errors),
            "wall_seconds": walls[run],  # the whole process: imports, data, launching ranks, training, validation
        }

    print("\n" + format_table(rows))
    # a property of the batches, not of a run: every run trains on the same ones
    print(f"plain DDP would mis-weight these batches' ranks by {rows['token_mean']['mean_naive_weight_error']:.3f}"
          " (mean over steps of max_r |P·n_r/N − 1|)")
    for run in RUNS:
        if rows[run]["first_flagged_message"]:
            print(f"\n{run}: {rows[run]['first_flagged_message']}")
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
        "losses": {run: [losses[run][step] for step in steps] for run in RUNS},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(out / "loss_curves.png", steps, losses, rows, args)
    print(f"\nRun folder: {out}")


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    header = (
        "run",
        "train loss",
        "val loss",
        "max |Δ loss| vs ref",
        "first flagged step",
        "audit error (step 0)",
        "wall s",
    )
    lines = [header]
    for run, row in rows.items():
        step, quantity = row["first_flagged_step"], row["first_flagged_quantity"]
        compared = run != "reference"
        lines.append(
            (
                run,
                f"{row['final_train_loss']:.4f}",
                f"{row['val_loss']:.4f}",
                f"{row['max_abs_loss_deviation']:.2e}" if compared else "—",
                ("none" if step is None else f"{step} ({quantity})") if compared else "—",
                _first_audit(row["audits"]) if compared else "—",
                f"{row['wall_seconds']:.1f}",
            )
        )
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
    """Top: the three loss curves and a zoom on the last steps; bottom: |loss − reference loss| per step, log scale."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    labels = {
        "reference": "reference: 1 process, whole global batch",
        "token_mean": f"TokenMeanDDPStrategy ({args.mode}), P={args.devices}, K={args.accumulate}",
        "naive": f"plain DDPStrategy, P={args.devices}, K={args.accumulate}",
    }
    styles: dict[str, dict[str, Any]] = {
        "reference": {"color": "black", "linewidth": 3.5, "alpha": 0.3},
        "token_mean": {"color": "tab:blue", "linewidth": 1.3, "linestyle": "--"},
        "naive": {"color": "tab:red", "linewidth": 1.3},
    }
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 8), height_ratios=(3, 2))
    zoom = top.inset_axes((0.42, 0.3, 0.55, 0.4))
    last = steps[-min(len(steps), 25) :]
    for run in RUNS:
        top.plot(steps, [losses[run][step] for step in steps], label=labels[run], **styles[run])
        zoom.plot(last, [losses[run][step] for step in last], **styles[run])
    zoom.set_title(f"zoom: the last {len(last)} steps", fontsize="small")
    zoom.tick_params(labelsize="small")
    top.indicate_inset_zoom(zoom, edgecolor="grey")
    top.set_ylabel("train loss: token mean of the step")
    top.set_title(
        f"Same global batches, same initialization; {args.precision}, SGD lr={LEARNING_RATE}, "
        f"{args.devices}×{args.accumulate} micro-batches of {args.micro_batch_size}",
        fontsize="medium",
    )
    top.legend(loc="upper right")
    top.annotate(
        "plain DDP's lower curve is a different objective (a mean of per-micro-batch means), not a better fit",
        (0.01, 0.02), xycoords="axes fraction", color=styles["naive"]["color"], fontsize="small",
    )

    for run in ("token_mean", "naive"):
        # log scale: a step that matches exactly (0) is left out rather than drawn at an arbitrary floor
        deviation = [abs(losses[run][step] - losses["reference"][step]) or math.nan for step in steps]
        bottom.plot(steps, deviation, label=labels[run].split(",")[0], **(styles[run] | {"linestyle": "-"}))
        flagged = rows[run]["first_flagged_step"]
        if flagged is not None:
            bottom.axvline(flagged, color=styles[run]["color"], linestyle=":", linewidth=1)
            quantity = rows[run]["first_flagged_quantity"]
            # the monitor compares N, loss, grad_norm and param_norm; only the loss is drawn here
            undrawn = "" if quantity == "loss" else ": not drawn here, it left the reference's before the loss did"
            bottom.annotate(
                f" DenominatorMonitor flags step {flagged} ({quantity}{undrawn})",
                (flagged, 0.55),
                xycoords=("data", "axes fraction"),
                color=styles[run]["color"],
                fontsize="small",
            )
    tolerance = [ATOL + RTOL * abs(losses["reference"][step]) for step in steps]
    bottom.plot(steps, tolerance, color="grey", linestyle=":", label="the monitor's tolerance")
    bottom.set_yscale("log")
    bottom.set_ylabel("|loss − reference loss|")
    bottom.set_xlabel("optimizer step")
    bottom.legend(loc="lower right", fontsize="small", ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--run", choices=("all", *RUNS), default="all", help="the demo (default), or one run alone")
    parser.add_argument("--steps", type=positive, default=120, help="optimizer steps of every run (default: 120)")
    parser.add_argument("--devices", type=positive, default=2, help="P, the DDP processes (default: 2)")
    parser.add_argument("--accumulate", type=positive, default=4, help="K, micro-batches per step and process")
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
