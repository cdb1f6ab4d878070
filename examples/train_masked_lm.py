"""Train a prompt-masked causal LM with TokenMeanDDPStrategy: the template to copy and adapt.

Each optimizer step follows the mean loss over all valid target tokens of the step, across processes and accumulated
micro-batches, where plain DDP would follow a mean of per-micro-batch means. The data are the Python standard
library's own functions (signature and docstring as the prompt, body as the target; examples/stdlib_corpus.py),
so nothing is downloaded. Swap `PairDataset`, `collate` and `TinyLM` for your own; keep the rest.

Commands, from the repository root (`make demo` creates .venv):

    .venv/bin/python examples/train_masked_lm.py                                   # 1 process, a GPU if there is one
    .venv/bin/python examples/train_masked_lm.py --accelerator cpu --devices 2     # 2 CPU processes (gloo)
    .venv/bin/python examples/train_masked_lm.py --accelerator gpu --devices 8 --precision bf16-mixed   # (nccl)
    .venv/bin/torchrun --nproc_per_node=8 examples/train_masked_lm.py --accelerator gpu --devices 8

Lightning starts the other processes itself (or finds torchrun's) and picks the backend from the accelerator.
Everything lands in --out: `trace.csv` (the denominator N, the exact loss and norms of every step, from
`DenominatorMonitor`), `checkpoints/` (`last.ckpt` and the best by validation loss, `step=S.ckpt`, numbered as
the trace) and `csv/metrics.csv`. It validates every --eval-every steps and after the last one.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples are scripts side by side, not a package
from arguments import positive, processes
from stdlib_corpus import PairDataset, collate, load_pairs, train_val_split
from tiny_lm import LMConfig, TinyLM, masked_lm_loss

from token_mean import (
    DenominatorMonitor,
    ExactDistributedSampler,
    TokenMeanDDPStrategy,
    TokenMeanLoss,
    count_valid_labels,
)

Batch = dict[str, Tensor]


class MaskedLM(pl.LightningModule):
    """``TinyLM`` on prompt/response pairs: the loss of a micro-batch is the mean over its response tokens."""

    def __init__(self, train_set: PairDataset, val_set: PairDataset, micro_batch_size: int, seed: int) -> None:
        super().__init__()
        self.train_set, self.val_set, self.micro_batch_size = train_set, val_set, micro_batch_size
        self.model = TinyLM(LMConfig(), seed=seed)  # seeded: the same weights on every rank and in every run
        self.val_loss = TokenMeanLoss()  # Σ loss sums / Σ counts over all ranks: no mean of per-batch means

    def train_dataloader(self) -> DataLoader[Batch]:
        # Lightning puts this behind a DistributedSampler (shuffle=True, seed=PL_GLOBAL_SEED) on P processes.
        return DataLoader(self.train_set, batch_size=self.micro_batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self) -> DataLoader[Batch]:
        # Every held-out pair on exactly one rank: Lightning's own sampler would repeat some to even the ranks out,
        # counting them twice. It is a DistributedSampler, so Lightning keeps it.
        sampler = ExactDistributedSampler(self.val_set, shuffle=False)
        return DataLoader(self.val_set, batch_size=self.micro_batch_size, sampler=sampler, collate_fn=collate)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        # The plain masked mean of this micro-batch: the strategy turns it into the step's global token mean.
        loss = masked_lm_loss(self.model(batch["input_ids"]), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)  # this micro-batch's loss; the exact one is in trace.csv
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.val_loss.update(masked_lm_loss(self.model(batch["input_ids"]), batch["labels"]), count_valid_labels(batch))
        self.log("val_loss", self.val_loss, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)


class PrintEvaluations(pl.Callback):
    """One line per validation, for a log file (where there is no progress bar): the last step's exact loss and N."""

    def __init__(self, monitor: DenominatorMonitor) -> None:
        self.monitor = monitor

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = self.monitor.last_window
        if trainer.sanity_checking or stats is None or not trainer.is_global_zero:
            return
        exact = "—" if stats.loss is None else f"{stats.loss:.4f}"
        val_loss = float(trainer.callback_metrics.get("val_loss", float("nan")))
        # the step that just ran, numbered as trace.csv, metrics.csv and the checkpoints number it
        print(f"step {trainer.global_step - 1}: exact train loss {exact} (N = {stats.global_count:.0f}),"
              f" val loss {val_loss:.4f} after it", flush=True)


class ValidateAtTheLastStep(pl.Callback):
    """Lightning stops at `max_steps` without validating unless `val_check_interval` lands there; a loop asked to stop
    validates first (and the checkpoints see that validation)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class StepCheckpoint(ModelCheckpoint):
    """Names a checkpoint by the last step it holds, as trace.csv and metrics.csv number it: Lightning's `{step}` is
    the number of steps taken, one more."""

    def format_checkpoint_name(self, metrics: dict[str, Tensor], filename: str | None = None, ver: int | None = None,
                               prefix: str | None = None) -> str:
        if "step" in metrics:
            metrics = {**metrics, "step": metrics["step"] - 1}
        return super().format_checkpoint_name(metrics, filename, ver, prefix)


def batches_per_epoch(pairs: int, processes: int, micro_batch_size: int, accumulate: int) -> int:
    """Micro-batches each process trains an epoch: whole windows of K, so that validations (every
    `eval_every * K` micro-batches) and the checkpoints they write fall on step boundaries. At most K - 1
    micro-batches an epoch are left out, other ones each epoch as the sampler reshuffles; a checkpoint inside a window
    could not be resumed (it holds none of the window's partial gradient)."""
    batches = math.ceil(math.ceil(pairs / processes) / micro_batch_size)  # per process: DistributedSampler pads
    return batches - batches % accumulate if batches >= accumulate else batches


def epochs_for(steps: int, pairs: int, processes: int, micro_batch_size: int, accumulate: int) -> int:
    """The epochs that `steps` optimizer steps reach into. Lightning's bar counts epochs and micro-batches: without
    `max_epochs` it reads `Epoch 0/-2` and measures micro-batches against `max_steps` (`40/20` at K = 2)."""
    batches = batches_per_epoch(pairs, processes, micro_batch_size, accumulate)
    return math.ceil(steps / math.ceil(batches / accumulate))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (default: auto, a GPU if one is seen)")
    parser.add_argument("--devices", type=processes, default="1", help="processes, one per device, or 'auto'")
    parser.add_argument("--accumulate", type=positive, default=4, help="K, micro-batches per step and process")
    parser.add_argument("--mode", choices=("lookahead", "deferred"), default="lookahead", help="TokenMeanDDPStrategy")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, 64-true, ...")
    parser.add_argument("--max-steps", type=positive, default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--eval-every", type=positive, default=100, help="optimizer steps between validations")
    parser.add_argument("--micro-batch-size", type=positive, default=8, help="pairs per micro-batch and process")
    parser.add_argument("--limit", type=positive, help="use only the first LIMIT pairs (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="initialization, split and shuffle (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/train_masked_lm"), help="checkpoints, trace, logs")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    pl.seed_everything(args.seed, verbose=False)  # also the seed of Lightning's DistributedSampler
    # 95% to train, 5% held out; reading the whole standard library takes a few seconds.
    train_pairs, val_pairs = train_val_split(load_pairs(limit=args.limit), seed=args.seed)
    monitor = DenominatorMonitor(record=args.out / "trace.csv")
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        # Counts labels != -100, right here as stdlib_corpus shifts the labels itself; a model that shifts inside
        # (Hugging Face's ...ForCausalLM computing .loss) needs count_fn=token_mean.count_shifted_labels.
        strategy=TokenMeanDDPStrategy(mode=args.mode),
        accumulate_grad_batches=args.accumulate,
        precision=args.precision,
        max_steps=args.max_steps,
        # Lightning counts micro-batches here, across epochs: epochs of whole windows keep it on step boundaries.
        val_check_interval=args.eval_every * args.accumulate,
        check_val_every_n_epoch=None,
        callbacks=[
            # Logs N, the per-rank counts and the exact loss every step and records them; no collective of its own.
            # On the bar: `exact_loss` and `N` (Lightning's `train_loss` there is the last micro-batch's).
            monitor,
            StepCheckpoint(dirpath=args.out / "checkpoints", filename="{step}", monitor="val_loss",
                           save_last=True),
            ValidateAtTheLastStep(),
            *([] if sys.stdout.isatty() else [PrintEvaluations(monitor)]),
        ],
        logger=CSVLogger(args.out, name="", version="csv"),
        log_every_n_steps=10,
        enable_progress_bar=sys.stdout.isatty(),  # in a log file a bar is a line per redraw
    )
    # max_steps stops the run; max_epochs only gives the bar its totals (an epoch's micro-batches, the epochs)
    shape = (len(train_pairs), trainer.world_size, args.micro_batch_size, args.accumulate)
    trainer.limit_train_batches = batches_per_epoch(*shape)
    trainer.fit_loop.max_epochs = epochs_for(args.max_steps, *shape)
    trainer.fit(MaskedLM(PairDataset(train_pairs), PairDataset(val_pairs), args.micro_batch_size, args.seed))
    if trainer.is_global_zero:
        print(f"val_loss {float(trainer.callback_metrics.get('val_loss', float('nan'))):.4f}; written to {args.out}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # what a distributed script does before it exits


if __name__ == "__main__":
    main(parse_args())
