"""What a mean of micro-batch means costs: the template ``train_masked_lm.py`` on the same global batches, with
and without the strategy, beside a 1-process reference, with the validation loss on short and on long targets.

A prompt-masked LM should average its loss over the valid target tokens of each optimizer step. With DDP and
gradient accumulation, Lightning averages per-micro-batch means (÷K) and DDP averages per-rank gradients (÷P): a
token of a micro-batch with few targets then weighs more than a token of one with many, and the objective depends on
how each global batch is cut into micro-batches. The data mix two sources from the standard library's functions
(``--no-names``: the first alone): writing a function's body from its signature and docstring (up to 192 target
tokens) and naming a function from the start of its body (~12). Every run trains the template's ``MaskedLM``
(its AdamW included) on exactly the same global batches in the same order, from the same initialization:

1. ``reference``: 1 process, no accumulation; each optimizer step sees its whole global batch at once: the P×K
   micro-batches that the P ranks' ``DistributedSampler`` deal out for that step, concatenated and re-padded
   (padding is masked, so the token mean is unchanged);
2. ``token_mean-PxK``: ``TokenMeanDDPStrategy`` on P processes with ``accumulate_grad_batches=K``, the global batch
   cut at random (Lightning's own ``DistributedSampler``, the template's loader); ``token_mean-PxK-by-length``: cut
   by length, each global batch sorted by sample length before it is cut (:class:`LengthGroupedBatches`, as a
   length-grouped sampler does to save padding), so that a micro-batch holds all-short or all-long targets;
3. ``plain-PxK`` and ``plain-PxK-by-length``: plain ``DDPStrategy``, the same cuts.

Every run records a ``DenominatorMonitor`` trace; the others are compared with the reference step by step (the
monitor flags the first step that leaves it) and audit their own gradients every ``AUDIT_EVERY`` steps. After the
last step each run is validated on the same held-out functions: the token-mean loss over all their targets, over the
targets shorter than ``SHORT_TARGETS`` tokens and over those of ``LONG_TARGETS`` or more. The script prints one line
per run and a table, and writes ``summary.json`` and ``layouts.png`` into one run folder,
``runs/masked_lm-<timestamp>/``, whose path it prints last.

Commands, from the repository root (``make demo`` creates ``.venv`` first if needed):

    make demo                                                          # the five runs: ~2 minutes on 2 CPU cores
    .venv/bin/python examples/masked_lm.py --steps 10 --limit 1000     # the same, smaller
    .venv/bin/python examples/masked_lm.py --layouts 1x8 2x4 4x2 --cuts random   # other layouts of one global batch
    .venv/bin/python examples/masked_lm.py --run reference --out runs/mine   # one run, in a single process
    .venv/bin/python examples/masked_lm.py --run plain --devices 2 --accumulate 4 --cut length --out runs/mine
    .venv/bin/torchrun --nproc_per_node=2 examples/masked_lm.py -- --run token_mean --accumulate 4 --out runs/mine
    .venv/bin/python examples/masked_lm.py --data my_pairs.jsonl       # your own {"prompt": ..., "response": ...} lines

The ``--`` after the script keeps torchrun from reading ``--run`` as an abbreviation of its own ``--run-path``.
A single ``--run`` writes ``OUT/<run>-<P>x<K>[-by-length]/`` (``OUT/reference/`` for the reference; ``OUT`` defaults
to ``runs/masked_lm``) and, when ``OUT/reference/`` holds a reference recorded on the same global batches, is
compared with it. ``--precision 64-true`` makes the token-mean runs match the reference to ~1e-15 instead of ~1e-7,
for about 1.5× the training time. The comparison runs on the CPU, where its tolerances were measured.
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
import re
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
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

# The examples are scripts beside each other, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import positive
from stdlib_corpus import IGNORE_INDEX, PairDataset, collate, load_pairs, train_val_split
from tiny_lm import LMConfig, TinyLM
from train_masked_lm import Batch, MaskedLM

from token_mean import TokenMeanDDPStrategy, TokenMeanLoss
from token_mean.callback import DenominatorMonitor

RUNS = ("reference", "token_mean", "plain")
LAYOUTS = ((2, 4),)  # (P, K): 2 processes × 4 micro-batches; `--layouts 1x8 2x4 4x2` cuts the global batch 3 ways
# How each step's global batch is cut into its P×K micro-batches: `random`, as Lightning's DistributedSampler deals
# it; `length`, sorted by sample length first, as a length-grouped sampler does to save padding. The global batches,
# and so the token-mean objective and the reference, are the same for both.
CUTS = ("random", "length")
CUT_WORDS = {"random": "at random", "length": "by length"}
# Enough steps for the weighting to show in the validation loss: with seeds 0 and 1 of the default demo, plain DDP's
# loss on long targets ends 0.03 to 0.11 above the reference's. Early steps learn what every token shares: in trials
# on the bodies alone, plain DDP's validation loss was within 1e-3 of the token mean's at step 50 of 100.
STEPS = 60
# The template's AdamW (lr 1e-3, weight decay 0.1), not SGD: AdamW's step barely depends on the gradient's scale, so
# the runs differ by how they weigh tokens, not by their step size. With SGD at a fixed learning rate a mean of means
# weighs up few-token micro-batches, whose mean gradients average over fewer tokens and are larger: it took larger
# steps and its losses were lower at 100 steps, a learning rate left untuned, not a better objective. AdamW divides
# by sqrt(v), so float32 round-off grows faster than under SGD, but stays inside the monitor's tolerance (RTOL).
OPTIMIZER = "AdamW(lr=1e-3, weight_decay=0.1): train_masked_lm.MaskedLM.configure_optimizers"
# Shorter than the corpus' own caps (256 and 383 bytes): a batch costs in proportion to its longest sample (and
# attention to its square), and the reference pads each step's whole global batch to one length. A body still has
# 2 to 192 target tokens and a name ~12, so micro-batches stay ragged.
PROMPT_BYTES = 64
RESPONSE_BYTES = 191
VAL_PAIRS = 128  # the first 128 functions of the held-out split: their bodies and, with --names, their names
# The validation loss is also reported on the held-out targets of fewer than SHORT_TARGETS tokens (the names and the
# shortest bodies) and of at least LONG_TARGETS (the long bodies): the tokens that a mean of means weighs up and down.
SHORT_TARGETS = 32
LONG_TARGETS = 128
# The second source of --names: the function's name (~12 target tokens) from the start of its body (the prompt).
NAME_PROMPT = "# name:\n"
DEFINITION = re.compile(r"\s*(?:async\s+)?def\s+(\w+)")
# The monitor compares N exactly, and loss, grad_norm and param_norm within ATOL + RTOL·|reference|.
# In float32 the token-mean run adds the same per-token terms in another order than the reference's single batch
# (per micro-batch, per rank, then gloo's all-reduce). Measured over 100 steps of the default settings (both cuts):
# at most 5e-7 relative on the loss, 7e-8 on the parameter norm and 4e-5 on the gradient norm, the most sensitive
# (AdamW turns a 1e-8 difference in the parameters into 1e-5 in the next gradient). 1e-4 (the monitor's default)
# leaves a 2.5× margin there, while plain DDP's gradient norm is off by 2e-2 to 9e-2 at step 0.
RTOL = 1e-4
ATOL = 1e-6
# The objective audit (docs/audit.md) of the DDP runs: the first window and every AUDIT_EVERY-th replayed on one
# module and compared with the gradient the optimizer is about to apply; no reference run needed.
AUDIT_EVERY = 50


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


class LengthGroupedBatches(Sampler[list[int]]):
    """Rank ``rank``'s micro-batches when each step's global batch is sorted by sample length before it is cut.

    The global batches are those of :class:`GlobalBatches`; each is sorted by length (longest first), cut into P×K
    micro-batches of B, and micro-batch j goes to rank j mod P, so every rank gets long and short ones. Padding then
    costs almost nothing, and a micro-batch holds all-short or all-long targets. Only whole global batches are dealt,
    so that every rank steps the same number of times (:func:`check_layouts` keeps the steps within them).
    """

    def __init__(self, dataset: PairDataset, devices: int, rank: int, accumulate: int, micro_batch_size: int,
                 seed: int) -> None:
        self.global_batches = GlobalBatches(dataset, devices, accumulate, micro_batch_size, seed)
        self.lengths = [sample_length(dataset, index) for index in range(len(dataset))]
        self.devices, self.rank, self.accumulate, self.micro_batch_size = devices, rank, accumulate, micro_batch_size
        self.sampler = self  # Lightning calls `set_epoch` on `batch_sampler.sampler` at every epoch start

    def set_epoch(self, epoch: int) -> None:
        self.global_batches.set_epoch(epoch)

    def __len__(self) -> int:
        return self.accumulate * sum(len(batch) == self.devices * self.accumulate * self.micro_batch_size
                                     for batch in self.global_batches)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches:
            if len(batch) < self.devices * self.accumulate * self.micro_batch_size:
                continue
            ordered = sorted(batch, key=lambda index: -self.lengths[index])
            micro_batches = [ordered[start : start + self.micro_batch_size]
                             for start in range(0, len(ordered), self.micro_batch_size)]
            yield from micro_batches[self.rank :: self.devices]


def sample_length(dataset: PairDataset, index: int) -> int:
    """The length of ``input_ids`` that ``dataset[index]`` will have, without encoding it."""
    prompt, response = dataset.pairs[index]
    return (min(len(prompt.encode()), dataset.max_prompt_bytes)
            + min(len(response.encode()), dataset.max_response_bytes) + 1)


class Comparison(MaskedLM):
    """The template's module (AdamW included) with the comparison's loaders and a validation loss by target length.

    ``batches``: ``"reference"`` (whole global batches, one process), ``"random"`` (the template's loader, under
    Lightning's ``DistributedSampler``) or ``"length"`` (:class:`LengthGroupedBatches`, one per rank).
    """

    def __init__(
        self,
        train_set: PairDataset,
        val_set: PairDataset,
        micro_batch_size: int,
        seed: int,
        batches: str,
        layout: tuple[int, int],
    ) -> None:
        super().__init__(train_set, val_set, micro_batch_size, seed)
        self.batches, self.layout, self.seed = batches, layout, seed
        # Sums over the held-out targets, per sample, so that a subset of the samples is a token mean of its own.
        self.val_loss = TokenMeanLoss(loss_reduction="sum")
        self.val_loss_short = TokenMeanLoss(loss_reduction="sum")
        self.val_loss_long = TokenMeanLoss(loss_reduction="sum")

    def train_dataloader(self) -> DataLoader[Batch]:
        devices, accumulate = self.layout
        sampler: Sampler[list[int]]
        if self.batches == "reference":
            sampler = GlobalBatches(self.train_set, devices, accumulate, self.micro_batch_size, self.seed)
        elif self.batches == "length":
            sampler = LengthGroupedBatches(self.train_set, devices, self.trainer.global_rank, accumulate,
                                           self.micro_batch_size, self.seed)
        else:
            return super().train_dataloader()
        return DataLoader(self.train_set, batch_sampler=sampler, collate_fn=collate)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        labels = batch["labels"]
        logits = self.model(batch["input_ids"])
        token_losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="none").view_as(labels)
        sums, counts = token_losses.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)
        self.val_loss.update(sums, counts)
        self.val_loss_short.update(sums, counts * (counts < SHORT_TARGETS))  # a count of 0 adds nothing
        self.val_loss_long.update(sums, counts * (counts >= LONG_TARGETS))
        for name in ("val_loss", "val_loss_short", "val_loss_long"):
            self.log(name, getattr(self, name))


# ----------------------------------------------------------------------------------------------------------------
# one run: one Trainer, in its own process(es)
# ----------------------------------------------------------------------------------------------------------------


def name_pairs(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The second source of ``--names``: for each pair whose prompt defines a function, the task of naming it from
    its body. Its targets are the name and EOS, ~12 tokens, where a body has up to 256."""
    names = []
    for prompt, body in pairs:
        definition = DEFINITION.match(prompt)
        if definition is not None:
            names.append((NAME_PROMPT + body, definition.group(1)))
    return names


def split_pairs(pairs: Sequence[tuple[str, str]], args: argparse.Namespace
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The training and validation pairs; with ``--names``, each split's functions are also asked for by name, so
    that a held-out function is held out in both sources."""
    train_pairs, val_pairs = train_val_split(pairs, seed=args.seed)
    val_pairs = val_pairs[:VAL_PAIRS]
    if args.names:
        return train_pairs + name_pairs(train_pairs), val_pairs + name_pairs(val_pairs)
    return train_pairs, val_pairs


def load_data(args: argparse.Namespace) -> tuple[list[tuple[str, str]], PairDataset, PairDataset]:
    """The pairs as read, and the training and validation sets."""
    pairs = load_pairs(limit=args.limit, data=args.data)
    train_pairs, val_pairs = split_pairs(pairs, args)
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
    layout = [args.steps, args.devices * args.accumulate, args.micro_batch_size, args.seed, args.names]
    return hashlib.sha256(json.dumps([pairs, layout]).encode()).hexdigest()[:16]


def check_layouts(dataset: Dataset[Any], layouts: Sequence[tuple[int, int]], steps: int, micro_batch_size: int,
                  seed: int) -> None:
    """Refuse layouts whose first ``steps`` global batches differ: P×K must be one number, and the steps must stay
    within an epoch's whole global batches (where the samplers pad their ranks, the layouts repeat other samples;
    the last global batch of an epoch may be short, and :class:`LengthGroupedBatches` deals only whole ones)."""
    if len({devices * accumulate for devices, accumulate in layouts}) != 1:
        raise SystemExit(f"--layouts {format_layouts(layouts)}: every layout must hold the same P×K micro-batches, so"
                         " that they train the same global batches.")
    batches = [list(GlobalBatches(dataset, devices, accumulate, micro_batch_size, seed)) for devices, accumulate
               in layouts]
    for step in range(steps):
        epoch, index = divmod(step, len(batches[0]))
        whole = len(batches[0][index]) == layouts[0][0] * layouts[0][1] * micro_batch_size
        if epoch or not whole or any(sorted(run[index]) != sorted(batches[0][index]) for run in batches):
            raise SystemExit(f"--steps {steps}: step {step} is past the first epoch's whole global batches, where the"
                             " layouts' samplers pad differently. Pass fewer --steps or a larger --limit.")


def format_layouts(layouts: Sequence[tuple[int, int]]) -> str:
    return " ".join(f"{devices}x{accumulate}" for devices, accumulate in layouts)


def run_name(run: str, devices: int, accumulate: int, cut: str = "random") -> str:
    if run == "reference":
        return run
    return f"{run}-{devices}x{accumulate}" + ("" if cut == "random" else f"-by-{cut}")


def train_one(args: argparse.Namespace) -> None:
    """``--run NAME``: train one run with its own Trainer, writing ``OUT/NAME-PxK/`` (``--cut length``:
    ``OUT/NAME-PxK-by-length/``; the reference: ``OUT/reference``)."""
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
    run_dir = out / run_name(args.run, args.devices, args.accumulate, args.cut)
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
                " --micro-batch-size, --seed and --names, or another --out."
            )
        reference = reference_trace

    strategy: Strategy | str
    if args.run == "reference":
        strategy, devices, accumulate = "auto", 1, 1
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
        # The length cut deals each rank its own micro-batches; the random cut is Lightning's DistributedSampler.
        use_distributed_sampler=args.cut == "random",
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # CSV rows are cheap; the monitor logs once per optimizer step
        callbacks=[monitor],
        logger=loggers,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,  # a bar redrawn per batch is hundreds of lines in a log; the parent prints one
    )
    batches = "reference" if args.run == "reference" else args.cut
    module = Comparison(train_set, val_set, args.micro_batch_size, args.seed, batches, (args.devices, args.accumulate))
    trainer.fit(module)
    # Once, after the last step: the same held-out pairs for every run, each on exactly one rank.
    [metrics] = trainer.validate(module, verbose=False)

    if trainer.is_global_zero:
        divergence = monitor.first_divergence
        result = {
            "run": args.run,
            "world_size": trainer.world_size,
            "accumulate_grad_batches": accumulate,
            "cut": None if args.run == "reference" else args.cut,
            "strategy": type(trainer.strategy).__name__,
            "val_loss": metrics["val_loss"],
            "val_loss_short": metrics["val_loss_short"],
            "val_loss_long": metrics["val_loss_long"],
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
    cuts: list[str] = args.cuts
    out = Path(args.out or f"runs/masked_lm-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    # Read the corpus once (a few seconds for the whole standard library) and hand the same file to every run.
    pairs = load_pairs(limit=args.limit, data=args.data)
    corpus = out / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8") as file:
        for prompt, response in pairs:
            file.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    train_pairs, _ = split_pairs(pairs, args)
    check_layouts(PairDataset(train_pairs, PROMPT_BYTES, RESPONSE_BYTES), layouts, args.steps, args.micro_batch_size,
                  args.seed)
    micro_batches = layouts[0][0] * layouts[0][1]
    parameters = sum(p.numel() for p in TinyLM(LMConfig()).parameters())
    names = f" and {len(name_pairs(pairs))} by name" if args.names else ""
    print(
        f"{len(pairs)} functions from {args.data or 'the standard library'}, asked for by body{names}"
        f" ({len(train_pairs)} pairs to train on); TinyLM with {parameters:,} parameters, {args.precision}, AdamW;"
        f" {args.steps} optimizer steps, each on the same global batch of {micro_batches} micro-batches ×"
        f" {args.micro_batch_size} samples, cut {' and '.join(CUT_WORDS[cut] for cut in cuts)}, laid out as P×K ="
        f" {format_layouts(layouts).replace(' ', ', ')}."
    )
    common = [f"--steps={args.steps}", f"--mode={args.mode}", f"--micro-batch-size={args.micro_batch_size}",
              f"--seed={args.seed}", f"--precision={args.precision}", f"--data={corpus}", f"--out={out}",
              "--names" if args.names else "--no-names"]
    plan = [("reference", *layouts[0], "random")] + [
        (run, *layout, cut) for run in RUNS[1:] for cut in cuts for layout in layouts
    ]
    walls: dict[str, float] = {}
    for index, (run, devices, accumulate, cut) in enumerate(plan, start=1):
        name = run_name(run, devices, accumulate, cut)
        what = {"reference": "1 process, each step's global batch at once",
                "token_mean": f"TokenMeanDDPStrategy(mode={args.mode!r}), P={devices}, K={accumulate}",
                "plain": f"DDPStrategy, P={devices}, K={accumulate}"}[run]
        if run != "reference":
            what += f", cut {CUT_WORDS[cut]}"
        print(f"run {index}/{len(plan)}: {name:<26} {what} ...", end="", flush=True)
        started = time.perf_counter()
        # A process per run: Lightning's launcher re-executes the command line in every rank it starts, so a script
        # that trained the runs in sequence would have its second rank redo the reference.
        subprocess.run([sys.executable, __file__, f"--run={run}", f"--devices={devices}",
                        f"--accumulate={accumulate}", f"--cut={cut}", *common], check=True)
        walls[name] = time.perf_counter() - started
        print(f" {walls[name]:.0f} s", flush=True)

    results = {name: json.loads((out / name / "result.json").read_text()) for name in walls}
    if len({result["data_digest"] for result in results.values()}) != 1:
        raise RuntimeError(f"The runs trained on different global batches: {results}. This is a bug in the example.")
    losses = {name: read_trace_column(out / name / "trace.csv", "loss") for name in walls}
    steps = sorted(losses["reference"])
    rows: dict[str, dict[str, Any]] = {}
    for name in walls:
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
    cutting = " and cuts" if len(cuts) > 1 else ""
    for run in RUNS[1:]:
        finals = [row["final_train_loss"] for row in rows.values() if row["run"] == run]
        print(f"{run:>10}: the final train losses of the {len(finals)} layouts{cutting} span"
              f" {max(finals) - min(finals):.2e}")
    summary = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {name: value for name, value in vars(args).items() if name not in ("run", "cut")},
        "model": {"parameters": parameters, "prompt_bytes": PROMPT_BYTES, "response_bytes": RESPONSE_BYTES},
        "optimizer": OPTIMIZER,
        "validation": {"functions": VAL_PAIRS, "short_targets_below": SHORT_TARGETS,
                       "long_targets_from": LONG_TARGETS},
        "monitor_tolerance": {"rtol": RTOL, "atol": ATOL},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
        "runs": rows,
        "steps": steps,
        "losses": {name: [losses[name][step] for step in steps] for name in walls},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(out / "layouts.png", steps, losses, rows, args)
    print(f"\nRun folder: {out}")


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    header = ("run", "cut", "P×K", "train loss", "|Δ| vs ref", "flagged at", "audit (step 0)", "val loss",
              f"short <{SHORT_TARGETS}", f"long ≥{LONG_TARGETS}", "wall s")
    lines = [header]
    for name, row in rows.items():
        step, quantity = row["first_flagged_step"], row["first_flagged_quantity"]
        compared = name != "reference"
        lines.append((
            row["run"],
            row["cut"] or "—",
            f"{row['world_size']}×{row['accumulate_grad_batches']}" if compared else "1, whole",
            f"{row['final_train_loss']:.4f}",
            f"{row['max_abs_loss_deviation']:.1e}" if compared else "—",
            ("none" if step is None else f"{step} ({quantity})") if compared else "—",
            _first_audit(row["audits"]) if compared else "—",
            f"{row['val_loss']:.4f}",
            f"{row['val_loss_short']:.4f}",
            f"{row['val_loss_long']:.4f}",
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
            label = (f"{strategy}, P×K = {row['world_size']}×{row['accumulate_grad_batches']},"
                     f" cut {CUT_WORDS[row['cut']]}")
            style = {"color": shade, "linewidth": 1.3, "linestyle": "--" if row["run"] == "token_mean" else "-"}
        top.plot(last, [losses[name][step] for step in last], label=label, **style)
        if name != "reference":
            # log scale: a step that matches exactly (0) is left out rather than drawn at an arbitrary floor
            deviation = [abs(losses[name][step] - losses["reference"][step]) or math.nan for step in steps]
            bottom.plot(steps, deviation, **(style | {"linestyle": "-"}))
    top.set_ylabel("train loss: token mean of the step")
    top.set_xlabel(f"optimizer step (the last {len(last)})")
    top.set_title(
        f"The same global batches and initialization, cut into P processes × K micro-batches; {args.precision}, AdamW",
        fontsize="medium",
    )
    top.legend(loc="upper right", fontsize="small")
    tolerance = [ATOL + RTOL * abs(losses["reference"][step]) for step in steps]
    bottom.plot(steps, tolerance, color="grey", linestyle=":", label="the monitor's tolerance")
    bottom.set_yscale("log")
    bottom.set_ylabel("|loss − reference loss|")
    bottom.set_xlabel("optimizer step")
    bottom.legend(loc="lower right", fontsize="small")
    bottom.set_title("token-mean runs: float32 round-off from the reference, however the batch is cut; plain DDP:"
                     " another objective for each cut", fontsize="small")
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
                        help=f"the demo's P×K layouts of one global batch (default: {format_layouts(LAYOUTS)})")
    parser.add_argument("--cuts", choices=CUTS, nargs="+", default=list(CUTS),
                        help="the demo's cuts of each global batch into micro-batches (default: random length)")
    parser.add_argument("--cut", choices=CUTS, default="random", help="--run: the cut (default: random)")
    parser.add_argument("--names", action=argparse.BooleanOptionalAction, default=True,
                        help="also train and validate on naming each function from its body (default: yes)")
    parser.add_argument("--steps", type=positive, default=STEPS, help=f"optimizer steps of a run (default: {STEPS})")
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
