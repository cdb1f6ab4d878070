"""Train the ragged token-level case on CUDA with NCCL under Lightning's subprocess launcher, one process per device,
and record what only a GPU run shows. Used by ``tests/test_gpu.py``; needs CUDA (``--cpu``: a rehearsal, below).

Rank 0 writes OUT_DIR/params.pt and OUT_DIR/windows.json (``_harness.Recorder``); every rank writes
OUT_DIR/rank{r}.json: how often deferred mode's DDP comm hook ran and how often it took NCCL's ``PREMUL_SUM``
(``token_mean._torch.premul_sum``), and what ``tests/_sync.py``'s ``SyncWatch`` saw: the micro-batches of every
window (``window_lengths``: those with gradient; the count check's replays without gradient are filed apart, in
``replays``), every synchronizing CUDA operation of the fit (``torch.cuda.set_sync_debug_mode("warn")``) with its
stage (inside a window, in the count check, outside), window, phase, optimizer steps begun, origin and stack, and
each run of the count check (after which window, before which optimizer step, its replays and syncs). The
strategy's read of the window's record after the last backward is outside the window, as the package documents it.

    python tests/scripts/gpu_token_mean.py OUT_DIR --strategy ddp --method deferred --devices 1
    python tests/scripts/gpu_token_mean.py OUT_DIR --strategy fsdp2 --method lookahead --devices 2
    python tests/scripts/gpu_token_mean.py OUT_DIR --strategy ddp --method plain --reads   # the watch's control
    python tests/scripts/gpu_token_mean.py OUT_DIR --strategy ddp --method lookahead --cpu  # the CPU rehearsal

``--reads``: ``training_step`` reads its loss on the host and a backward hook reads the loss's gradient, in every
micro-batch: what the watch must see. ``--cpu``: the same fit on the CPU with gloo, the watch rehearsing CUDA's syncs
(``SyncWatch(rehearse=True)``): the bookkeeping of the lane, checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import Batch, Recorder, TokenModule, empty_like, ragged_batches
from _mesh import MeshModule
from _sync import SyncWatch

from token_mean import TokenMeanDDPStrategy, TokenMeanModelParallelStrategy, _layout, _torch

DATA_SEED, BATCHES, ACCUMULATE = 23, 12, 3  # 4 windows of 3
STEADY = 2  # windows from this one on: DDP rebuilt its buckets and FSDP2 initialized in the first two
STRATEGIES = ("ddp", "fsdp2")
METHODS = ("plain", "lookahead", "deferred")


def data(ranks: int) -> list[list[Batch]]:
    """Ragged per-rank batches, with a fully masked micro-batch on rank 0 (a 0/0 mean on CUDA)."""
    batches = ragged_batches(ranks, BATCHES, seed=DATA_SEED)
    batches[0][4] = empty_like(batches[0][4])
    return batches


# ---------------------------------------------------------------------------------------------------------------
# deferred mode's comm hook and NCCL's PREMUL_SUM, counted in every rank
# ---------------------------------------------------------------------------------------------------------------


class Calls:
    hook = 0  # bucket all-reduces through deferred mode's comm hook
    premul_sum = 0  # of which built NCCL's PREMUL_SUM op


def count_hook_calls() -> None:
    """Wrap the hook before DDP registers it (``_layout._install_hook`` reads the module global) and the op."""
    hook, premul_sum = _layout.scaled_allreduce_hook, _torch.premul_sum

    # No annotations: DDP compares a hook's annotations with the real classes (see token_mean/_comm_hook.py).
    def counted_hook(state, bucket):  # type: ignore[no-untyped-def]
        Calls.hook += 1
        return hook(state, bucket)

    def counted_premul_sum(factor: Tensor) -> Any:
        Calls.premul_sum += 1
        return premul_sum(factor)

    _layout.scaled_allreduce_hook = counted_hook
    _torch.premul_sum = counted_premul_sum


# ---------------------------------------------------------------------------------------------------------------
# synchronizing CUDA operations (tests/_sync.py), written by every rank with the comm hook counts
# ---------------------------------------------------------------------------------------------------------------


class RankWatch(SyncWatch):
    """:class:`SyncWatch`, whose record every rank writes to ``rank{r}.json`` with the comm hook counts."""

    def __init__(self, directory: Path, rehearse: bool) -> None:
        super().__init__(rehearse)
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        record = {
            "rank": trainer.global_rank, "hook_calls": Calls.hook, "premul_sum_calls": Calls.premul_sum,
            **self.record(),
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# the fit
# ---------------------------------------------------------------------------------------------------------------


def read_loss_and_its_gradient(module: TokenModule, batch: Batch, loss: Tensor) -> Tensor:
    """The watch's control: a host read in the forward, and one in the backward, of every micro-batch."""
    float(loss)
    if loss.requires_grad:
        loss.register_hook(_read_gradient)
    return loss


def _read_gradient(gradient: Tensor) -> None:
    float(gradient)


def strategy_for(strategy: str, method: str, devices: int, backend: str) -> Strategy:
    if strategy == "ddp":
        if method == "plain":
            return DDPStrategy(process_group_backend=backend)
        return TokenMeanDDPStrategy(mode=method, process_group_backend=backend)  # type: ignore[arg-type]
    sizes: dict[str, Any] = {"data_parallel_size": devices, "tensor_parallel_size": 1, "process_group_backend": backend}
    if method == "plain":
        return ModelParallelStrategy(**sizes)
    return TokenMeanModelParallelStrategy(mode=method, **sizes)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--method", choices=METHODS, default="deferred")
    parser.add_argument("--devices", type=int, default=1, help="processes, one per CUDA device")
    parser.add_argument("--reads", action="store_true", help="training_step and its backward read on the host")
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: CPU processes, gloo, syncs rehearsed")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_token_mean.py needs CUDA: run it on a machine with a GPU (tests/test_gpu.py skips without one)")
    args.out.mkdir(parents=True, exist_ok=True)
    count_hook_calls()
    module_class = MeshModule if args.strategy == "fsdp2" else TokenModule
    module = module_class(data(args.devices), output_fn=read_loss_and_its_gradient if args.reads else None)
    backend = "gloo" if args.cpu else "nccl"
    trainer = pl.Trainer(
        accelerator="cpu" if args.cpu else "gpu", devices=args.devices,
        strategy=strategy_for(args.strategy, args.method, args.devices, backend),
        accumulate_grad_batches=ACCUMULATE, max_epochs=1,
        callbacks=[Recorder(args.out), RankWatch(args.out, rehearse=args.cpu)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(module)
    torch.distributed.destroy_process_group()  # before the interpreter finalizes (see test_spawn_launcher)


if __name__ == "__main__":
    main()
