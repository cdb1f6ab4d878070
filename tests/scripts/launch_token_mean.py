"""Train the ragged token-level case on two gloo ranks under any launcher; rank 0 writes OUT_DIR/MODE/params.pt.

The data and the Trainer are fixed (`data()`, `ACCUMULATE`, `EPOCHS`) so that tests can compare with the reference.
Several modes train one after the other in the same processes (under fork and spawn: in fresh workers, and a mode
that fails does not stop the next; the script then exits with status 1).

    python tests/scripts/launch_token_mean.py OUT_DIR --mode deferred                        # subprocess launcher
    python tests/scripts/launch_token_mean.py OUT_DIR --mode lookahead --by-name    # strategy="ddp_token_mean"
    python tests/scripts/launch_token_mean.py OUT_DIR --mode lookahead deferred --start-method spawn
    torchrun --standalone --nproc_per_node=2 tests/scripts/launch_token_mean.py OUT_DIR --mode lookahead deferred
    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=127.0.0.1 --master_port=29400 \\
        tests/scripts/launch_token_mean.py OUT_DIR --nodes 2        # and the same command with --node_rank=1

A rank that stalls: at batch 1 rank 1 stops answering until it is terminated, and rank 0 must fail within the
collective timeout. The process that sees the failure writes it to OUT_DIR/MODE/error-{rank0,rank1,launcher}.txt
(under fork and spawn the launcher reports its workers' errors), and rank 1 writes OUT_DIR/MODE/rank1_left.txt when it
stalls:

    python tests/scripts/launch_token_mean.py OUT_DIR --mode lookahead --start-method fork --rank1 stall --timeout 5

`--rank1 nan` makes rank 1's loss NaN at that batch instead: every rank raises the same `DenominatorError`.

Each process that trained writes OUT_DIR/exit-rank{r}.json as the interpreter begins to exit, after the package's
own exit handler (``tests/_jobs.py``): whether the default process group was still registered then, and whether it
was freed (the script itself never destroys it, unless ``--destroy`` asks it to, as torch recommends, at the end of
each fit; a process that finalizes with a live gloo group aborts now and then).

Under popen and spawn the timeout also bounds the rendezvous, which waits for the child processes to import torch and
Lightning (3 to 15 s on a busy 2-core machine): a 5 s timeout can fail there, before training starts. Forked workers
start at once.
"""

from __future__ import annotations

import argparse
import atexit
import json
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import Batch, Recorder, TokenModule, ragged_batches
from _jobs import ExitReport

from token_mean import DenominatorMonitor, TokenMeanDDPStrategy

DATA_SEED, BATCHES, ACCUMULATE, EPOCHS = 11, 7, 3, 2
LEAVE_AT_BATCH = 1  # inside the first window (K = 3): rank 0 next waits in the window's collective


def data() -> list[list[Batch]]:
    return ragged_batches(2, BATCHES, seed=DATA_SEED)


class StallingRank(TokenModule):
    """Rank 1 stops answering inside `training_step` at `LEAVE_AT_BATCH` of the first epoch, until it is terminated."""

    def __init__(self, data: list[list[Batch]], out: Path) -> None:
        super().__init__(data)
        self.out = out

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        if self.global_rank == 1 and self.current_epoch == 0 and batch_idx == LEAVE_AT_BATCH:
            (self.out / "rank1_left.txt").write_text(f"stalled at batch {batch_idx}")
            # Lightning's handler only records a SIGTERM; the default lets the launcher end this rank at once
            # instead of after torch's 30 s grace period, once rank 0 has failed.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                signal.pause()
        return super().training_step(batch, batch_idx)


class NaNRank(TokenModule):
    """Rank 1's loss is NaN at `LEAVE_AT_BATCH` of the first epoch: every rank raises the same `DenominatorError`."""

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.current_epoch == 0 and batch_idx == LEAVE_AT_BATCH:
            return loss * float("nan")
        return loss


class RunInfo(Callback):
    """Rank 0 writes how Lightning set the job up: the cluster environment it detected, the world size and nodes."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            environment = getattr(trainer.strategy, "cluster_environment", None)
            info = {"environment": type(environment).__name__, "world_size": trainer.world_size,
                    "strategy": type(trainer.strategy).__name__}
            (self.out / "run.json").write_text(json.dumps({**info, "num_nodes": trainer.num_nodes}))


class DestroyProcessGroup(Callback):
    """What torch asks a distributed script to do when it is done: destroy the default process group (``--destroy``;
    ``test_spawn_launcher`` too).

    Destroying only unregisters the group: Lightning's dropped DDP wrappers still hold it, with its gloo threads, and
    the package's exit handler must free it before the interpreter finalizes (in a spawned worker too), or the
    process aborts now and then after a finished fit. A `report` notes the group first (it watches a group it saw
    while training), so it can say whether the group destroyed here was freed.
    """

    def __init__(self, report: ExitReport | None = None) -> None:
        self.report = report

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if self.report is not None:
                self.report.trained(trainer.global_rank)
            torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--mode", nargs="+", choices=("lookahead", "deferred", "plain"), default=["lookahead"],
        help="plain: DDPStrategy with a DenominatorMonitor, which measures on the default process group",
    )
    parser.add_argument("--start-method", choices=("popen", "spawn", "fork"), default="popen", help="not torchrun")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: one process per node (torchrun)")
    parser.add_argument("--rank1", choices=("stall", "nan"), help="make rank 1 stop answering, or its loss NaN")
    parser.add_argument("--timeout", type=float, help="seconds a collective may wait (DDP's `timeout`)")
    parser.add_argument("--destroy", action="store_true", help="destroy the process group after each fit")
    parser.add_argument("--by-name", action="store_true", help='lookahead as `strategy="ddp_token_mean"` (popen)')
    args = parser.parse_args()
    if args.start_method == "fork":
        torch.set_num_threads(1)  # an OpenMP pool that has run does not survive a fork

    report = ExitReport(args.out)  # says nothing for a fork/spawn launcher, which never trains itself
    atexit.register(report)
    failed = False
    for mode in args.mode:
        out: Path = args.out / mode
        out.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
        strategy: DDPStrategy | str
        callbacks: list[Callback] = [Recorder(out), RunInfo(out)]
        if args.destroy:
            callbacks.append(DestroyProcessGroup(report))
        if mode == "plain":
            strategy = DDPStrategy(start_method=args.start_method, process_group_backend="gloo", **kwargs)
            callbacks.append(DenominatorMonitor())
        elif args.by_name and mode == "lookahead" and args.start_method == "popen" and not kwargs:
            strategy = "ddp_token_mean"  # the registry's: its defaults, gloo on the CPU
        else:
            strategy = TokenMeanDDPStrategy(
                mode=mode, start_method=args.start_method, process_group_backend="gloo", **kwargs
            )
        trainer = pl.Trainer(
            accelerator="cpu", devices=2 // args.nodes, num_nodes=args.nodes, strategy=strategy,
            accumulate_grad_batches=ACCUMULATE, max_epochs=EPOCHS, callbacks=callbacks,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, num_sanity_val_steps=0,
        )
        try:
            module = {None: TokenModule, "nan": NaNRank}[args.rank1](data()) if args.rank1 != "stall" \
                else StallingRank(data(), out)
            trainer.fit(module)
        except BaseException as error:
            # fork and spawn: this is the launcher, reporting the error of the first worker that failed
            launcher = args.start_method in ("fork", "spawn")
            (out / f"error-{'launcher' if launcher else f'rank{trainer.global_rank}'}.txt").write_text(
                f"{type(error).__name__}: {error}"
            )
            if not launcher or not isinstance(error, Exception):
                raise  # this process's own process group is broken
            failed = True  # the next mode trains in fresh workers
            continue
        report.trained(trainer.global_rank)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
