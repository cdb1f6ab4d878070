"""Step time of ``TokenMeanModelParallelStrategy`` (lookahead, deferred) against plain ``ModelParallelStrategy`` on the
same device mesh, model, data and optimizer.

    .venv/bin/python benchmarks/model_parallel.py                   # FSDP2 over 2 gloo CPU processes, ~1-2 min
    .venv/bin/python benchmarks/model_parallel.py --mesh 2x2        # FSDP2 × tensor parallelism, 4 processes
    .venv/bin/python benchmarks/model_parallel.py --quick           # smoke test, < 1 min, into a temporary folder
    .venv/bin/python benchmarks/model_parallel.py --json out.json --markdown out.md

Lightning's own subprocess launcher (the only one ``ModelParallelStrategy`` has) re-runs this script in every child,
and every rank runs the same sequence of fits: plain, lookahead, deferred, plain, lookahead, deferred, ... A callback
inside the workers stamps each optimizer step; the first ``--warmup`` steps of a fit are not timed, so start-up and
set-up are excluded. Each repetition gives a ratio (seconds per step of the mode / of plain in the same repetition);
the result is their median, with the spread. Rank 0 writes the JSON and markdown with the date, hardware, versions
and configuration. On a shared machine, read the ratio, never an absolute time.

The model is a token MLP (``Linear(64, 1024)-tanh-Linear(1024, 128)``, float32) whose ``hidden`` layer is
``ColwiseParallel`` and ``out`` ``RowwiseParallel`` on the tensor-parallel dimension, ``fully_shard`` on the
data-parallel one: the ``configure_model`` of docs/model_parallel.md. Micro-batches are 8 rows of 64 tokens with
per-rank mask rates far apart (ragged counts), K = ``--accumulate``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import environment, environment_markdown, markdown_table, output_paths, quiet_lightning, write_results
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader

from token_mean import TokenMeanModelParallelStrategy

METHODS = ("plain", "lookahead", "deferred")
FEATURES, HIDDEN, CLASSES = 64, 1024, 128
ROWS, LENGTH = 8, 64
KEEP = (0.9, 0.2)  # the share of target tokens per data-parallel rank: counts differ several-fold
Batch = dict[str, Tensor]


def batches(data_parallel_rank: int, count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(data_parallel_rank)
    keep = KEEP[data_parallel_rank % len(KEEP)]
    result = []
    for _ in range(count):
        labels = torch.randint(0, CLASSES, (ROWS, LENGTH), generator=generator)
        masked = torch.rand(ROWS, LENGTH, generator=generator) >= keep
        x = torch.randn(ROWS, LENGTH, FEATURES, generator=generator)
        result.append({"x": x, "labels": labels.masked_fill(masked, -100)})
    return result


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(FEATURES, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(x)))


class MeshModule(pl.LightningModule):
    def __init__(self, micro_batches: int) -> None:
        super().__init__()
        self.net = MLP()
        self.micro_batches = micro_batches

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        assert mesh is not None
        if mesh["tensor_parallel"].size() > 1:
            plan = {"hidden": ColwiseParallel(), "out": RowwiseParallel()}
            parallelize_module(self.net, mesh["tensor_parallel"], plan)
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        logits = self.net(batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Batch]:
        mesh = self.device_mesh
        assert mesh is not None
        return DataLoader(batches(mesh["data_parallel"].get_local_rank(), self.micro_batches), batch_size=None)


class StepClock(Callback):
    """Stamps the end of every optimizer step (on every rank; rank 0's are reported)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.stamps.append(time.perf_counter())


def strategy_for(method: str, data_parallel: int, tensor_parallel: int) -> ModelParallelStrategy:
    kwargs: dict[str, Any] = {
        "data_parallel_size": data_parallel, "tensor_parallel_size": tensor_parallel, "process_group_backend": "gloo",
    }
    if method == "plain":
        return ModelParallelStrategy(**kwargs)
    return TokenMeanModelParallelStrategy(mode=method, **kwargs)  # type: ignore[arg-type]


def seconds_per_step(method: str, args: argparse.Namespace, data_parallel: int, tensor_parallel: int) -> float:
    steps = args.warmup + args.steps
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu", devices=data_parallel * tensor_parallel, strategy=strategy_for(method, data_parallel,
        tensor_parallel), accumulate_grad_batches=args.accumulate, max_steps=steps, callbacks=[clock],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(MeshModule(steps * args.accumulate))
    timed = clock.stamps[args.warmup - 1 :]
    return (timed[-1] - timed[0]) / (len(timed) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="2x1", help="DATA_PARALLELxTENSOR_PARALLEL (default 2x1: FSDP2 alone)")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per fit")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per fit")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions of plain/lookahead/deferred")
    parser.add_argument("--quick", action="store_true", help="2 warm-up and 4 timed steps, 1 repetition (temp folder)")
    parser.add_argument("--json", type=Path, help="default: benchmarks/results/model_parallel.json")
    parser.add_argument("--markdown", type=Path, help="default: benchmarks/results/model_parallel.md")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.repeats = 2, 4, 1
    data_parallel, tensor_parallel = (int(size) for size in args.mesh.split("x"))
    torch.set_num_threads(1)  # one intra-op thread per process: the processes share the machine's cores
    quiet_lightning()
    warnings.filterwarnings("ignore", ".*returned a view tensor.*")  # FSDP2 on a 3-d Linear output; no in-place op

    times: dict[str, list[float]] = {method: [] for method in METHODS}
    for _ in range(args.repeats):
        for method in METHODS:
            times[method].append(seconds_per_step(method, args, data_parallel, tensor_parallel))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() != 0:
        return

    configuration = {
        "mesh": {"data_parallel": data_parallel, "tensor_parallel": tensor_parallel}, "accumulate": args.accumulate,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats, "dtype": "float32",
        "model": f"Linear({FEATURES},{HIDDEN})-tanh-Linear({HIDDEN},{CLASSES})", "micro_batch": [ROWS, LENGTH],
        "optimizer": "AdamW", "launcher": "Lightning subprocess launcher, gloo",
    }
    env = environment(configuration)
    ratios = {method: [mode / plain for mode, plain in zip(times[method], times["plain"], strict=True)]
              for method in METHODS[1:]}
    payload = {
        "environment": env,
        "seconds_per_step": times,
        "ratios": ratios,
        **{f"ratio_{method}": statistics.median(values) for method, values in ratios.items()},
    }
    json_path, markdown_path = output_paths(args, "model_parallel")  # rank 0 only: every rank runs this script
    rows = [["plain", f"{statistics.median(times['plain']) * 1e3:.1f}", "1", "—"]]
    for method, values in ratios.items():
        rows.append([method, f"{statistics.median(times[method]) * 1e3:.1f}", f"{statistics.median(values):.3f}",
                     f"{min(values):.3f}–{max(values):.3f}"])
    table = markdown_table(["method", "ms per step (median)", "ratio to plain (median)", "ratio range"], rows)
    mesh = f"{data_parallel} data-parallel × {tensor_parallel} tensor-parallel"
    text = f"# Model parallel: step time against plain ModelParallelStrategy ({mesh}, K = {args.accumulate})\n\n"
    text += f"{environment_markdown(env)}\n\n{table}\n"
    write_results(json_path, markdown_path, payload, text)
    print(text)
    print(json.dumps({key: value for key, value in payload.items() if key.startswith("ratio_")}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
