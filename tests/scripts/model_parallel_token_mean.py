"""Train the ragged token-level case with `TokenMeanModelParallelStrategy` under Lightning's own subprocess launcher
(the only one `ModelParallelStrategy` has), FSDP2 over two data-parallel gloo ranks; rank 0 writes OUT_DIR/params.pt
and OUT_DIR/windows.json.

    python tests/scripts/model_parallel_token_mean.py OUT_DIR [--mode deferred]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import Batch, Recorder, ragged_batches
from _mesh import MeshModule

from token_mean import TokenMeanModelParallelStrategy

DATA_SEED, BATCHES, ACCUMULATE = 12, 7, 3


def data() -> list[list[Batch]]:
    return ragged_batches(2, BATCHES, seed=DATA_SEED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=("lookahead", "deferred"), default="deferred")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    strategy = TokenMeanModelParallelStrategy(
        mode=args.mode, data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, accumulate_grad_batches=ACCUMULATE, max_epochs=1,
        callbacks=[Recorder(args.out)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(MeshModule(data()))
    torch.distributed.destroy_process_group()  # before the interpreter finalizes (see test_spawn_launcher)


if __name__ == "__main__":
    main()
