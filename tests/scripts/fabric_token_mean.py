"""Train the LitGPT-shaped Fabric loop of tests/_fabric.py with TokenMeanAccumulator on two gloo ranks under any of
Fabric's launchers; rank 0 writes OUT_DIR/MODE/params.pt and OUT_DIR/MODE/windows.json (every window's stats).

The data and the loop are fixed (`data()`, `ACCUMULATE`, `EPOCHS`) so that tests can compare with the reference.
Several modes train one after the other: under popen and torchrun in the same two processes (the second
`fabric.launch()` finds the process group the first one set up), under spawn and fork each in fresh workers
(`fabric.launch(train, ...)`).

    python tests/scripts/fabric_token_mean.py OUT_DIR --mode deferred lookahead                 # subprocess launcher
    python tests/scripts/fabric_token_mean.py OUT_DIR --mode lookahead deferred --start-method spawn
    python tests/scripts/fabric_token_mean.py OUT_DIR --mode lookahead deferred --start-method fork
    torchrun --standalone --nproc_per_node=2 tests/scripts/fabric_token_mean.py OUT_DIR --mode lookahead deferred

Rank 0 also writes OUT_DIR/MODE/run.json: the cluster environment Fabric detected and the world size. Each process
that trained writes OUT_DIR/exit-rank{r}.json as the interpreter begins to exit, after the package's own exit handler
(``tests/_jobs.py``): whether the default process group was still registered then, and whether it was freed (the
script never destroys it). Forked
workers leave with ``os._exit``, which runs no exit handler: under fork no process writes a report.
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _fabric import accumulator_loop
from _harness import Batch, empty_like, ragged_batches
from _jobs import ExitReport

DATA_SEED, BATCHES, ACCUMULATE, EPOCHS = 13, 7, 3, 2  # windows [0..2] [3..5] [6] per pass: a short last one

_reports: list[ExitReport] = []  # this process's report, once registered (says nothing in a fork/spawn launcher)


def data() -> list[list[Batch]]:
    """Ragged batches, per-rank mask rates far apart, and one micro-batch without a target on rank 0."""
    batches = ragged_batches(2, BATCHES, seed=DATA_SEED)
    batches[0][1] = empty_like(batches[0][1])
    return batches


def report_at_exit(out: Path) -> None:
    """Once per process, before the first accumulator (whose construction registers the package's handler)."""
    if not _reports:
        _reports.append(ExitReport(out))
        atexit.register(_reports[0])


def train(fabric: Fabric, out: Path, mode: str) -> None:
    """One mode on every rank: the accumulator loop over `data()`; rank 0 writes what it trained to."""
    report_at_exit(out)
    windows: list[dict[str, object]] = []
    params = accumulator_loop(fabric, data(), ACCUMULATE, mode, epochs=EPOCHS, windows=windows)
    _reports[0].trained(fabric.global_rank)
    if fabric.global_rank == 0:
        folder = out / mode
        torch.save(params, folder / "params.pt")
        (folder / "windows.json").write_text(json.dumps(windows))
        environment = type(fabric.strategy.cluster_environment).__name__  # type: ignore[attr-defined]
        (folder / "run.json").write_text(json.dumps({"environment": environment, "world_size": fabric.world_size}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", nargs="+", choices=("lookahead", "deferred"), default=["lookahead"])
    parser.add_argument("--start-method", choices=("popen", "spawn", "fork"), default="popen", help="not torchrun")
    args = parser.parse_args()
    if args.start_method == "fork":
        torch.set_num_threads(1)  # an OpenMP pool that has run does not survive a fork
    for mode in args.mode:
        (args.out / mode).mkdir(parents=True, exist_ok=True)
        strategy = DDPStrategy(start_method=args.start_method, process_group_backend="gloo")
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        if args.start_method == "popen":  # re-runs this script per rank (under torchrun: only connects)
            fabric.launch()
            train(fabric, args.out, mode)
        else:
            fabric.launch(train, args.out, mode)


if __name__ == "__main__":
    main()
