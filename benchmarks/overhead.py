"""Overhead: optimizer steps per second of lookahead and deferred mode against plain ``DDPStrategy``.

Same model, data, layout and optimizer for the three methods, 2 forked gloo CPU processes, K ∈ {1, 4}, at two sizes:
``tiny`` (a 2-layer token MLP, where the strategy's fixed per-step costs dominate) and ``tinylm`` (the example's
TinyLM on real prompt-masked batches of the standard-library corpus). One ``Trainer.fit`` per (method, repetition)
runs many steps; a callback inside the workers times the optimizer steps after a warm-up, so process start-up and
Trainer set-up are excluded. Fits are interleaved plain/lookahead/deferred, plain/lookahead/deferred, ...; each
repetition gives a ratio (seconds per step of the mode / of plain DDP in the same repetition), and the table shows
their median and spread. Peak host memory (VmHWM, reset when training starts) is read by each rank.

It also times the strategy's one collective in isolation (an all-reduce of the window record, gloo, 2 processes)
and, during training, how long the host waits for it (``Exchange.wait``: 0 when the last backward hid it). ``tiny``
is the test suite's own model and data (``tests/_harness.py``).

    .venv/bin/python benchmarks/overhead.py            # ~6 min on 2 idle cores
    .venv/bin/python benchmarks/overhead.py --quick    # < 60 s, smaller batches and fewer repetitions (temp folder)
    .venv/bin/python benchmarks/overhead.py --json out.json --markdown out.md

Target: median ratio ≤ 1.02 at K=4 on tinylm. Ranks are timed on rank 0; ratios, never single absolute times, are
the result on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _common import (
    add_output_arguments,
    environment,
    environment_markdown,
    markdown_table,
    output_paths,
    quiet_lightning,
    write_results,
)
from _harness import METHODS, Batch, ListDataset, TokenModule, cast, sft_batches, strategy_for, train
from lightning.pytorch.callbacks import Callback
from stdlib_corpus import PairDataset, collate, load_pairs
from tiny_lm import LMConfig, TinyLM, masked_lm_loss
from torch import Tensor
from torch.multiprocessing.spawn import start_processes
from torch.utils.data import DataLoader

from token_mean import _lightning
from token_mean._record import RECORD_SIZE, Exchange

# Workers are forked from this process, and a forked child deadlocks in its first parallel op if the parent's
# OpenMP pool has run: one intra-op thread per process (2 processes on 2 cores), set before any torch op.
torch.set_num_threads(1)

DEVICES = 2
ACCUMULATIONS = (1, 4)


@dataclass
class Settings:
    warmup_steps: int  # untimed optimizer steps at the start of every fit (allocator, caches, first-window sync)
    timed_steps: int  # optimizer steps timed per fit
    repeats: int  # interleaved repetitions of plain/lookahead/deferred
    lm_batch_size: int  # samples per micro-batch for tinylm; a micro-batch of 4 is ~0.45 s of one core


# Short fits, many repetitions: on a shared machine the load drifts within seconds, and a ratio is only as good as
# the pairing of the fits it divides.
FULL = Settings(warmup_steps=1, timed_steps=3, repeats=11, lm_batch_size=4)
QUICK = Settings(warmup_steps=1, timed_steps=2, repeats=2, lm_batch_size=2)


# ---------------------------------------------------------------------------------------------------------------
# the two workloads
# ---------------------------------------------------------------------------------------------------------------


class LMModule(pl.LightningModule):
    """The example's model: ``training_step`` returns the masked mean cross-entropy of its micro-batch."""

    def __init__(self, shards: list[list[Batch]]) -> None:
        super().__init__()
        self.model = TinyLM(LMConfig(), seed=0)
        self.shards = shards

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss: Tensor = masked_lm_loss(self.model(batch["input_ids"]), batch["labels"])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)

    def train_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(ListDataset(self.shards[self.global_rank]), batch_size=None)


def lm_shards(micro_batches: int, batch_size: int) -> list[list[Batch]]:
    """Real corpus batches, collated once in the parent: rank r takes every DEVICES-th batch, as a sampler would."""
    pairs = load_pairs(limit=DEVICES * micro_batches * batch_size)
    dataset = PairDataset(pairs)
    batches = [
        collate([dataset[i] for i in range(start, start + batch_size)])
        for start in range(0, DEVICES * micro_batches * batch_size, batch_size)
    ]
    return [batches[rank::DEVICES] for rank in range(DEVICES)]


def make_workload(model: str, micro_batches: int, settings: Settings) -> Callable[[], pl.LightningModule]:
    """A factory of fresh modules over fixed data, so that every fit starts from the same weights."""
    if model == "tiny":
        data = cast(sft_batches("sft", DEVICES, micro_batches, seed=0), torch.float32)
        return lambda: TokenModule(data, dtype=torch.float32, lr=0.1, momentum=0.9)
    shards = lm_shards(micro_batches, settings.lm_batch_size)
    return lambda: LMModule(shards)


# ---------------------------------------------------------------------------------------------------------------
# timing and memory inside the workers
# ---------------------------------------------------------------------------------------------------------------


class _ExchangeClock:
    """Wall time the host spends waiting for the strategy's window record (``Exchange.wait``, which ``read`` and
    deferred mode's gradient hook call): the exposed part of its one collective, waiting for the slower rank
    included. Plain DDP has no such record. Installed in the parent, inherited by the forked workers."""

    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        if not getattr(Exchange.wait, "_timed", False):
            Exchange.wait = cls._wrap(Exchange.wait)  # type: ignore[method-assign]

    @classmethod
    def _wrap(cls, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                cls.seconds += time.perf_counter() - started

        timed._timed = True  # type: ignore[attr-defined]
        return timed


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


class StepTimer(Callback):
    """Stamps the end of every optimizer step (wall, CPU, gather clocks); each rank writes them and its peak RSS."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.stamps: list[tuple[float, float, float]] = []
        self.peak_reset = False

    @staticmethod
    def _now() -> tuple[float, float, float]:
        # process_time: CPU of every thread of this rank, gloo's included; it leaves out time spent descheduled
        return time.perf_counter(), time.process_time(), _ExchangeClock.seconds

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:  # "5" resets VmHWM to the current RSS (Linux ≥ 4.0), so the peak is that of training alone
            Path("/proc/self/clear_refs").write_text("5")
            self.peak_reset = True
        except OSError:
            self.peak_reset = False
        self.start_rss_kib = _status_kib("VmRSS")
        self.stamps = [self._now()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # the step of a window has run when this batch closed it (Lightning's `_should_accumulate` is False)
        if _lightning.steps_after_this_batch(trainer):
            self.stamps.append(self._now())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "stamps": self.stamps, "peak_rss_kib": _status_kib("VmHWM"), "start_rss_kib": self.start_rss_kib,
            "peak_reset": self.peak_reset,
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@dataclass
class Run:
    model: str
    accumulate: int
    method: str
    repeat: int
    seconds_per_step: float  # wall, rank 0
    cpu_seconds_per_step: float  # CPU time, mean over ranks
    exchange_ms_per_step: float  # waiting for the window record (Exchange.wait), max over ranks (0 for plain DDP)
    peak_rss_mib: float  # max over ranks
    rss_growth_mib: float  # max over ranks of (peak during training − RSS when training started)


def timed_fit(
    model: str, accumulate: int, method: str, repeat: int, module: pl.LightningModule, settings: Settings, tmp: Path
) -> Run:
    directory = tmp / f"{model}-K{accumulate}-{method}-{repeat}"
    directory.mkdir()
    train(
        module, strategy_for(method), DEVICES, callbacks=[StepTimer(directory)], accumulate_grad_batches=accumulate,
        max_steps=settings.warmup_steps + settings.timed_steps,
    )
    ranks = [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(DEVICES)]
    per_step: list[list[float]] = []  # per rank: (wall, cpu, exchange wait) seconds per timed step
    for rank in ranks:
        timed = rank["stamps"][settings.warmup_steps :]
        if len(timed) != settings.timed_steps + 1:
            raise RuntimeError(f"expected {settings.timed_steps + 1} timed step ends, got {len(timed)}")
        per_step.append([(timed[-1][i] - timed[0][i]) / settings.timed_steps for i in range(3)])
    return Run(
        model, accumulate, method, repeat,
        seconds_per_step=per_step[0][0],  # ranks meet in every step's gradient all-reduce: rank 0 sees the pace
        cpu_seconds_per_step=statistics.mean(r[1] for r in per_step),
        exchange_ms_per_step=max(r[2] for r in per_step) * 1e3,
        peak_rss_mib=max(r["peak_rss_kib"] for r in ranks) / 1024,
        rss_growth_mib=max(r["peak_rss_kib"] - r["start_rss_kib"] for r in ranks) / 1024,
    )


# ---------------------------------------------------------------------------------------------------------------
# the window record's collective in isolation
# ---------------------------------------------------------------------------------------------------------------


def _collective_worker(rank: int, init_file: str, out: str, iterations: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DEVICES)
    record = torch.zeros(RECORD_SIZE, dtype=torch.float64)
    bucket = torch.zeros(25 * 2**20 // 4, dtype=torch.float32)  # DDP's default 25 MiB bucket

    def median_us(op: Callable[[], object], repeat: int) -> float:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            op()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e6

    dist.barrier()
    result = {
        "all_reduce_record_us": median_us(lambda: dist.all_reduce(record), iterations),
        "barrier_us": median_us(dist.barrier, iterations),
        "all_reduce_25MiB_us": median_us(lambda: dist.all_reduce(bucket), max(iterations // 50, 3)),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def collective_latency(tmp: Path, iterations: int) -> dict[str, float]:
    """Median time of one blocking gloo collective between DEVICES forked processes."""
    out = tmp / "collectives.json"
    start_processes(
        _collective_worker, args=(str(tmp / "init"), str(out), iterations), nprocs=DEVICES, start_method="fork"
    )
    result: dict[str, float] = json.loads(out.read_text())
    # ring all-reduce moves 2(P−1)/P · S bytes per rank: S itself for P = 2
    result["all_reduce_bus_GBps"] = 25 * 2**20 / (result["all_reduce_25MiB_us"] * 1e-6) / 1e9
    return result


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> tuple[float, float, float, float]:
    """Median, first and third quartiles, and the min–max width of the per-repetition ratios."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return statistics.median(ordered), q1, q3, ordered[-1] - ordered[0]


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for model in dict.fromkeys(r.model for r in runs):
        for accumulate in dict.fromkeys(r.accumulate for r in runs if r.model == model):
            cell = [r for r in runs if r.model == model and r.accumulate == accumulate]
            plain = {r.repeat: r for r in cell if r.method == "plain"}
            for method in METHODS:
                mine = [r for r in cell if r.method == method]
                ratios = [r.seconds_per_step / plain[r.repeat].seconds_per_step for r in mine]
                cpu_ratios = [r.cpu_seconds_per_step / plain[r.repeat].cpu_seconds_per_step for r in mine]
                median, q1, q3, width = spread(ratios)
                step = statistics.median(r.seconds_per_step for r in mine)
                best = min(r.seconds_per_step for r in mine) / min(r.seconds_per_step for r in plain.values())
                rows.append({
                    "model": model, "accumulate": accumulate, "method": method,
                    "median_seconds_per_step": step, "steps_per_second": 1 / step,
                    "ratio_median": median, "ratio_q1": q1, "ratio_q3": q3,
                    "ratio_min": min(ratios), "ratio_max": max(ratios), "ratio_min_max_width": width,
                    "ratios": ratios, "ratio_best": best, "cpu_ratio_median": statistics.median(cpu_ratios),
                    "cpu_seconds_per_step": statistics.median(r.cpu_seconds_per_step for r in mine),
                    "exchange_ms_per_step": statistics.median(r.exchange_ms_per_step for r in mine),
                    "exchange_share": statistics.median(
                        r.exchange_ms_per_step / 1e3 / r.seconds_per_step for r in mine
                    ),
                    "peak_rss_mib": statistics.median(r.peak_rss_mib for r in mine),
                    "rss_growth_mib": statistics.median(r.rss_growth_mib for r in mine),
                })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "model", "K", "method", "steps/s", "ratio (median)", "IQR", "min–max", "best/best", "CPU ratio",
        "exchange wait ms/step", "its share", "peak RSS MiB", "RSS growth MiB",
    ]
    body = [
        [
            r["model"], r["accumulate"], r["method"], f"{r['steps_per_second']:.3g}", f"{r['ratio_median']:.3f}",
            f"{r['ratio_q1']:.3f}–{r['ratio_q3']:.3f}", f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f}",
            f"{r['ratio_best']:.3f}", f"{r['cpu_ratio_median']:.3f}", f"{r['exchange_ms_per_step']:.2f}",
            f"{r['exchange_share']:.1%}",
            f"{r['peak_rss_mib']:.0f}", f"{r['rss_growth_mib']:.1f}",
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "overhead")  # --quick: fewer, smaller steps and 2 repetitions (< 60 s)
    args = parser.parse_args()
    json_path, markdown_path = output_paths(args, "overhead")
    quiet_lightning()
    settings = QUICK if args.quick else FULL
    env = environment({
        **asdict(settings), "devices": DEVICES, "accumulations": list(ACCUMULATIONS), "backend": "gloo, fork",
        "tiny": "tests/_harness.py TokenNet Linear(5,6)-tanh-Linear(6,7) on sft_batches('sft') of 4 rows, float32,"
        " SGD(momentum=0.9)",
        "tinylm": f"examples/tiny_lm.py TinyLM(LMConfig()) ~0.51M params, {settings.lm_batch_size} stdlib-corpus"
        " samples per micro-batch (up to 640 tokens), AdamW",
        "timing": "rank 0, end of warm-up step to end of last step, per fit; ratio per repetition vs plain",
        "quick": args.quick,
    })
    started = time.perf_counter()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        collectives = collective_latency(tmp, iterations=100 if args.quick else 1000)
        _ExchangeClock.install()
        for model in ("tiny", "tinylm"):
            for accumulate in ACCUMULATIONS:
                micro_batches = (settings.warmup_steps + settings.timed_steps) * accumulate
                make = make_workload(model, micro_batches, settings)
                for repeat in range(settings.repeats):
                    for method in METHODS:  # interleaved: drift on a shared machine hits all three alike
                        runs.append(timed_fit(model, accumulate, method, repeat, make(), settings, tmp))
                print(f"{model} K={accumulate} done ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = summarize(runs)
    key = {r["method"]: r for r in rows if r["model"] == "tinylm" and r["accumulate"] == max(ACCUMULATIONS)}
    ratios = {f"ratio_{method}": key[method]["ratio_median"] for method in ("lookahead", "deferred")}
    payload = {
        **ratios, "target": 1.02, "environment": env, "collectives_gloo_2proc": collectives, "rows": rows,
        "runs": [asdict(r) for r in runs],
    }
    collective_line = (
        f"gloo, 2 processes, median of one blocking call: all_reduce of the {RECORD_SIZE}-float64 window record"
        f" {collectives['all_reduce_record_us']:.0f} µs, barrier {collectives['barrier_us']:.0f} µs, all_reduce of a"
        " 25 MiB bucket"
        f" {collectives['all_reduce_25MiB_us'] / 1e3:.1f} ms ({collectives['all_reduce_bus_GBps']:.2f} GB/s)."
    )
    markdown = "\n\n".join([
        "### Overhead: seconds per optimizer step against plain DDPStrategy (2 gloo processes)",
        environment_markdown(env),
        f"{settings.repeats} interleaved repetitions; each fit: {settings.warmup_steps} warm-up + "
        f"{settings.timed_steps} timed optimizer steps. Ratio = time per step of the method / plain DDP's in the"
        " same repetition (< 1 is faster); best/best = fastest fit of the method / fastest plain fit; CPU ratio ="
        " median paired ratio of CPU time per step (mean over ranks), which a busy machine inflates least; exchange"
        " wait = wall time per step the host spent waiting for the strategy's window record (its one all-reduce,"
        " waiting for the slower rank included), and its share of the step time. RSS growth = peak during training"
        " − RSS when training started, max over ranks.",
        table(rows),
        collective_line,
    ])
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")
    for name, value in ratios.items():
        print(f"{name} (tinylm, K={max(ACCUMULATIONS)}): {value:.3f}")


if __name__ == "__main__":
    main()
