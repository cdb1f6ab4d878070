"""Train a prompt-masked causal LM in a hand-written Lightning Fabric loop with TokenMeanAccumulator: the template
for a LitGPT-style script.

Each optimizer step follows the mean loss over all valid target tokens of the step, across processes and accumulated
micro-batches, where LitGPT's `fabric.backward(loss / K)` follows a mean of per-micro-batch means. The corpus and
the model are the Trainer template's (examples/train_masked_lm.py): the standard library's functions as
prompt/response pairs (examples/stdlib_corpus.py) and a tiny GPT (examples/tiny_lm.py); nothing is downloaded.

Commands, from the repository root (`make demo` creates .venv):

    .venv/bin/python examples/fabric_masked_lm.py                                  # 1 process, a GPU if there is one
    .venv/bin/python examples/fabric_masked_lm.py --accelerator cpu --devices 2    # 2 CPU processes (gloo), DDP
    .venv/bin/python examples/fabric_masked_lm.py --accelerator cpu --devices 2 --strategy fsdp --mode deferred
    .venv/bin/torchrun --nproc_per_node=8 examples/fabric_masked_lm.py --accelerator gpu --devices 8 \\
        --strategy fsdp --precision bf16-mixed                                     # (nccl)

Fabric starts the other processes itself by re-running this script (or finds torchrun's) and picks the backend from
the accelerator. Everything lands in --out: `trace.csv` (the denominator N, the exact loss and the norms of every
step, from `FabricMonitor`), `csv/metrics.csv` (Fabric's CSVLogger) and `last.ckpt` (model, optimizer and the
accumulator's state; under fsdp a folder of shards, as `fabric.save` writes a distributed checkpoint).

Against LitGPT's loop (litgpt/finetune/lora.py, `fit`), the changes are:

    LitGPT                                              here
    batch = next(CycleIterator(train_dataloader))       for batch in accumulator.batches(train_dataloader):
    is_accumulating = iter_num % K != 0                 accumulator.accumulating
    fabric.backward(loss / K)                           accumulator.backward(loss)
    if not is_accumulating: optimizer.step()            stats = accumulator.finish(); if not stats.skipped: step
    loss of logits[..., :-1, :] on targets[..., 1:]     count_fn=count_shifted_labels (this corpus shifts the
                                                        labels itself: the default, count_valid_labels)
    validate(): losses.mean() of per-batch means        TokenMeanLoss: Σ loss sums / Σ counts over all ranks

`fabric.setup_dataloaders` stays as it is: in lookahead mode the accumulator reads the host batches beneath the loader
a window ahead, counts them there, and moves each batch to the device as the loop takes it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import ModelParallelStrategy
from torch import Tensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples are scripts side by side, not a package
from arguments import positive, processes
from stdlib_corpus import PairDataset, collate, load_pairs, train_val_split
from tiny_lm import LMConfig, TinyLM, masked_lm_loss

from token_mean import ExactDistributedSampler, TokenMeanLoss, count_valid_labels
from token_mean.fabric import TokenMeanAccumulator
from token_mean.fabric_monitor import FabricMonitor

Batch = dict[str, Tensor]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (default: auto, a GPU if one is seen)")
    parser.add_argument("--devices", type=processes, default="1", help="processes, one per device, or 'auto'")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                        help="ddp, or fsdp: FSDP2 (fully_shard) through Fabric's ModelParallelStrategy")
    parser.add_argument("--accumulate", type=positive, default=4, help="K, micro-batches per step and process")
    parser.add_argument("--mode", choices=("lookahead", "deferred"), default="lookahead", help="TokenMeanAccumulator")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, ...")
    parser.add_argument("--max-steps", type=positive, default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--eval-every", type=positive, default=100, help="optimizer steps between validations")
    parser.add_argument("--micro-batch-size", type=positive, default=8, help="pairs per micro-batch and process")
    parser.add_argument("--limit", type=positive, help="use only the first LIMIT pairs (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="initialization, split and shuffle (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/fabric_masked_lm"), help="trace, logs, checkpoint")
    return parser.parse_args(argv)


def parallelize(model: TinyLM, device_mesh: Any) -> TinyLM:
    """FSDP2, as LitGPT shards its blocks: each block, then the root (embeddings, final norm, tied head)."""
    from torch.distributed.fsdp import fully_shard

    # The mesh's 'data_parallel' dimension: FSDP2 then averages gradients over exactly the ranks N is counted over.
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def make_fabric(args: argparse.Namespace) -> Fabric:
    devices: Any = int(args.devices) if args.devices.isdigit() else args.devices
    strategy: Any = "ddp"
    if args.strategy == "fsdp":
        if not isinstance(devices, int):
            raise ValueError(f"`--strategy fsdp` needs `--devices` as a number (the data-parallel size): {devices}.")
        strategy = ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=devices, tensor_parallel_size=1
        )
    return Fabric(
        accelerator=args.accelerator, devices=devices, strategy=strategy, precision=args.precision,
        loggers=CSVLogger(args.out, name="", version="csv"),
    )


def micro_batch_loss(model: Any, batch: Batch) -> Tensor:
    return masked_lm_loss(model(batch["input_ids"]), batch["labels"])


@torch.no_grad()
def validate(fabric: Fabric, model: Any, val_loader: Any, batches: int, val_loss: TokenMeanLoss) -> float:
    """The exact token mean over every held-out pair (each on exactly one rank)."""
    model.eval()
    val_loss.reset()
    seen = 0
    for batch in val_loader:
        val_loss.update(masked_lm_loss(model(batch["input_ids"]), batch["labels"]), count_valid_labels(batch))
        seen += 1
    # Under fsdp every forward all-gathers the parameters, so every rank runs as many: a rank whose share of the
    # held-out pairs is shorter runs the rest on a one-token input and counts nothing (under ddp: one tiny forward).
    for _ in range(batches - seen):
        model(torch.zeros(1, 1, dtype=torch.long, device=fabric.device))
    model.train()
    return float(val_loss.compute())  # syncs the two sums over the data-parallel ranks: one host read


def main(args: argparse.Namespace) -> None:
    fabric = make_fabric(args)
    fabric.launch()  # the subprocess launcher re-runs this script per process; under torchrun it only connects
    fabric.seed_everything(args.seed)  # also the seed of the DistributedSampler that setup_dataloaders puts in
    mesh = getattr(fabric.strategy, "device_mesh", None)
    # tensor_parallel_size=1: every rank is a data-parallel rank, and the validation sums reduce over that group
    data_parallel_group = None if mesh is None else mesh["data_parallel"].get_group()

    # 95% to train, 5% held out; reading the whole standard library takes a few seconds.
    train_pairs, val_pairs = train_val_split(load_pairs(limit=args.limit), seed=args.seed)
    val_set = PairDataset(val_pairs)
    train_loader = DataLoader(PairDataset(train_pairs), batch_size=args.micro_batch_size, shuffle=True,
                              collate_fn=collate)
    # Every held-out pair on exactly one rank: a DistributedSampler would repeat some to even the ranks out.
    val_sampler = ExactDistributedSampler(val_set, num_replicas=fabric.world_size, rank=fabric.global_rank,
                                          shuffle=False)
    val_loader = DataLoader(val_set, batch_size=args.micro_batch_size, sampler=val_sampler, collate_fn=collate)
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)  # a DistributedSampler for train
    # the most validation batches any rank has: one collective, once
    val_batches = int(fabric.all_reduce(torch.tensor(len(val_loader), device=fabric.device), reduce_op="max"))

    model = TinyLM(LMConfig(), seed=args.seed)  # seeded: the same weights on every rank and in every run
    model = fabric.setup_module(model)  # under fsdp: parallelize() shards it, then the optimizer sees the shards
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))

    # Logs N, the per-rank counts and the exact loss every step (fabric.log_dict) and records them in trace.csv.
    monitor = FabricMonitor(record=args.out / "trace.csv")
    # count_fn: the default, count_valid_labels (labels != -100), right here as stdlib_corpus shifts the labels itself
    # and masked_lm_loss scores logits[t] against labels[t]; a loss of logits[..., :-1, :] against labels[..., 1:]
    # (LitGPT's) needs count_fn=token_mean.count_shifted_labels.
    # loss_fn: the loss the loop passes to accumulator.backward; the count check replays it at the first window
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=args.accumulate, mode=args.mode, monitor=monitor,
                                       loss_fn=micro_batch_loss)
    val_loss = TokenMeanLoss(process_group=data_parallel_group).to(fabric.device)

    step, last_val = 0, float("nan")
    while step < args.max_steps:
        for batch in accumulator.batches(train_loader):  # one pass; every rank yields as many batches
            with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
                loss = micro_batch_loss(model, batch)  # this micro-batch's mean over its valid labels
                accumulator.backward(loss)  # instead of fabric.backward(loss / K)
            if accumulator.accumulating:
                continue
            stats = accumulator.finish()  # the window's one host read; the gradient is now the exact token mean
            if not stats.skipped:  # N == 0 on every rank: no update
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.eval_every == 0 or step == args.max_steps:
                last_val = validate(fabric, model, val_loader, val_batches, val_loss)
                fabric.log_dict({"val_loss": last_val}, step=step)
                exact = "—" if stats.loss is None else f"{stats.loss:.4f}"  # None: a window without items
                # the step that just ran, numbered as trace.csv numbers it (from 0)
                fabric.print(f"step {step - 1}: exact train loss {exact} (N = {stats.global_count:.0f}),"
                             f" val loss {last_val:.4f} after it")
            if step == args.max_steps:
                # inside the pass, so that the accumulator's state says where in it a resumed run goes on
                state = {"model": model, "optimizer": optimizer, "accumulator": accumulator.state_dict(), "step": step}
                fabric.save(args.out / "last.ckpt", state)
                break
    monitor.close()
    fabric.logger.finalize("success")
    fabric.print(f"val_loss {last_val:.4f}; written to {args.out}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # what a distributed script does before it exits


if __name__ == "__main__":
    main(parse_args())
