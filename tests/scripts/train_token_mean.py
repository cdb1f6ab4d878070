"""Train with `strategy="ddp_token_mean"`, Lightning's default subprocess launcher, as users run it.

    python tests/scripts/train_token_mean.py OUT_DIR
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import Recorder, TokenModule, ragged_batches

import token_mean  # noqa: F401  (registers "ddp_token_mean")

if __name__ == "__main__":
    out = Path(sys.argv[1])
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_token_mean", accumulate_grad_batches=3, max_epochs=2,
        callbacks=[Recorder(out)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(TokenModule(ragged_batches(2, 7, seed=11)))
    torch.distributed.destroy_process_group()  # before the interpreter finalizes (see test_spawn_launcher)
