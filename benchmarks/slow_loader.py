"""Slow loader: how long each optimizer step waits for data, lookahead and deferred against plain DDPStrategy.

The loader's ``__getitem__`` sleeps 30 ms (a tokenizer, a remote store) and 2 worker processes read it, so it
delivers one batch per ~15 ms; each micro-batch's ``training_step`` sleeps 10 ms on top of the test suite's token
model, standing for the accelerator's compute (under DDP the host waits for it before every batch anyway, when
Lightning reads its SIGTERM flag with ``.item()``), so a micro-batch takes ~15-20 ms here with Lightning's own work:
the loader barely keeps pace, plain DDP waits a little every step, and a reading pattern that leaves the workers
idle shows at once (reading K − 1 batches in one burst at each window's start, say, waits for most of them: the
workers keep only a few batches prefetched). Plain DDP takes one batch per micro-batch; lookahead reads the next
window one batch per micro-batch (rolling) and holds at most K batches ahead; deferred reads nothing ahead. K = 16.

"Data wait" is the wall time spent inside the loader iterator's ``__next__``, whoever calls it (Lightning's fetcher
or the strategy's read-ahead), per optimizer step, on rank 0, except the call that finds the end of the epoch (it
raises StopIteration after the DataLoader shut its workers down, tens of ms, once per epoch): reported on its own.
Plain DDP trusts a sized loader's ``len()`` and never makes that call (it pays the shutdown later, when the iterator
is dropped); deferred makes it after the last batch ``len()`` promised, the check that a loader longer than its
``len()`` is not cut short silently (issue 22). The first window of a fit is the warm-up (worker
start-up; lookahead also reads its K batches before the first forward, once per epoch) and is reported on its own;
the timed steps follow. Fits are interleaved plain/lookahead/deferred; the ratio is paired within a repetition.
Peak host memory: VmHWM of each rank (reset when training starts), and the most batches the rank held between the
loader and ``training_step`` (yielded minus trained).

    .venv/bin/python benchmarks/slow_loader.py            # ~2 min on 2 cores -> benchmarks/results/slow_loader.*
    .venv/bin/python benchmarks/slow_loader.py --quick    # ~30 s, into a temporary folder

Target: the median data wait per step of lookahead and deferred within 10 % of plain DDP's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import (
    add_output_arguments,
    environment,
    environment_markdown,
    markdown_table,
    output_paths,
    quiet_lightning,
    write_results,
)
from _harness import METHODS, Batch, TokenModule, make_batch, strategy_for, train
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from token_mean import _lightning

# Workers are forked from this process: one intra-op thread, set before any torch op (see fidelity.py).
torch.set_num_threads(1)

DEVICES = 2
ACCUMULATE = 16
WORKERS = 2
LOAD_SECONDS = 0.030  # per __getitem__: one batch
COMPUTE_SECONDS = 0.010  # per training_step, standing for the accelerator's forward and backward
ROWS, LENGTH = 8, 256  # tokens per micro-batch: x is 8 × 256 × 5 float64 (80 KiB), labels 16 KiB
TARGET = 1.10


@dataclass
class Settings:
    timed_steps: int  # optimizer steps timed per fit, after the first (warm-up) window
    repeats: int  # interleaved repetitions of plain/lookahead/deferred


FULL = Settings(timed_steps=6, repeats=9)
QUICK = Settings(timed_steps=2, repeats=1)


class SlowDataset(Dataset[Batch]):
    """Each item is a whole micro-batch, after LOAD_SECONDS of pretended work."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        time.sleep(LOAD_SECONDS)
        return self.batches[index]


class _TimedIterator:
    """The DataLoader's iterator, timing every ``next`` and counting the batches it yields."""

    wait_seconds = 0.0
    end_seconds = 0.0  # the calls that found the end (StopIteration): they shut the workers down
    yielded = 0

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            batch = next(self._iterator)
        except StopIteration:
            _TimedIterator.end_seconds += time.perf_counter() - started
            raise
        _TimedIterator.wait_seconds += time.perf_counter() - started
        _TimedIterator.yielded += 1
        return batch


class TimedLoader(DataLoader[Batch]):
    def __iter__(self) -> Any:
        return _TimedIterator(super().__iter__())


class SlowModule(TokenModule):
    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        time.sleep(COMPUTE_SECONDS)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader[Batch]:
        return TimedLoader(SlowDataset(self.data[self.global_rank]), batch_size=None, num_workers=WORKERS)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


class WaitRecorder(Callback):
    """Per rank: the data wait and wall clock at the end of every optimizer step, batches held, peak RSS."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.stamps: list[tuple[float, float, float]] = []
        self.trained = 0
        self.most_held = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of training alone
        self.start_rss_kib = _status_kib("VmRSS")
        self.stamps = [self._stamp()]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.trained += 1
        self.most_held = max(self.most_held, _TimedIterator.yielded - self.trained)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.most_held = max(self.most_held, _TimedIterator.yielded - self.trained)
        if _lightning.steps_after_this_batch(trainer):  # this batch closed a window: its step has run
            self.stamps.append(self._stamp())

    @staticmethod
    def _stamp() -> tuple[float, float, float]:
        return time.perf_counter(), _TimedIterator.wait_seconds, _TimedIterator.end_seconds

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "stamps": self.stamps, "most_held": self.most_held, "peak_rss_kib": _status_kib("VmHWM"),
            "start_rss_kib": self.start_rss_kib,
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@dataclass
class Run:
    method: str
    repeat: int
    first_window_wait_s: float  # rank 0: data wait of the warm-up window (worker start-up, lookahead's first read)
    wait_per_step_s: float  # rank 0, timed steps
    end_of_stream_s: float  # rank 0, timed steps: the next() calls that raised StopIteration (once per epoch)
    seconds_per_step: float  # rank 0, timed steps
    most_held: int  # max over ranks: batches yielded by the loader and not yet trained
    peak_rss_mib: float  # max over ranks
    rss_growth_mib: float  # max over ranks: peak during training − RSS when training started


def data(settings: Settings) -> list[list[Batch]]:
    generator = torch.Generator().manual_seed(0)
    batches = (1 + settings.timed_steps) * ACCUMULATE
    return [[make_batch(generator, ROWS, LENGTH, 0.5) for _ in range(batches)] for _ in range(DEVICES)]


def timed_fit(method: str, repeat: int, batches: list[list[Batch]], settings: Settings, tmp: Path) -> Run:
    directory = tmp / f"{method}-{repeat}"
    directory.mkdir()
    train(
        SlowModule(batches), strategy_for(method), DEVICES, callbacks=[WaitRecorder(directory)],
        accumulate_grad_batches=ACCUMULATE,
    )
    ranks = [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(DEVICES)]
    stamps = ranks[0]["stamps"]
    if len(stamps) != settings.timed_steps + 2:
        raise RuntimeError(f"expected {settings.timed_steps + 2} stamps, got {len(stamps)}")
    (_, wait_start, _), (warm, wait_warm, end_warm), (end, wait_end, end_end) = stamps[0], stamps[1], stamps[-1]
    return Run(
        method, repeat,
        first_window_wait_s=wait_warm - wait_start,
        wait_per_step_s=(wait_end - wait_warm) / settings.timed_steps,
        end_of_stream_s=end_end - end_warm,
        seconds_per_step=(end - warm) / settings.timed_steps,
        most_held=max(rank["most_held"] for rank in ranks),
        peak_rss_mib=max(rank["peak_rss_kib"] for rank in ranks) / 1024,
        rss_growth_mib=max(rank["peak_rss_kib"] - rank["start_rss_kib"] for rank in ranks) / 1024,
    )


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    plain = {run.repeat: run for run in runs if run.method == "plain"}
    rows = []
    for method in METHODS:
        mine = [run for run in runs if run.method == method]
        ratios = [run.wait_per_step_s / plain[run.repeat].wait_per_step_s for run in mine]
        step_ratios = [run.seconds_per_step / plain[run.repeat].seconds_per_step for run in mine]
        rows.append({
            "method": method,
            "wait_ms_per_step": statistics.median(run.wait_per_step_s for run in mine) * 1e3,
            "wait_ratio_median": statistics.median(ratios), "wait_ratios": ratios,
            "step_ms": statistics.median(run.seconds_per_step for run in mine) * 1e3,
            "step_ratio_median": statistics.median(step_ratios),
            "first_window_wait_ms": statistics.median(run.first_window_wait_s for run in mine) * 1e3,
            "end_of_stream_ms": statistics.median(run.end_of_stream_s for run in mine) * 1e3,
            "most_held": max(run.most_held for run in mine),
            "peak_rss_mib": statistics.median(run.peak_rss_mib for run in mine),
            "rss_growth_mib": statistics.median(run.rss_growth_mib for run in mine),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "slow_loader")
    args = parser.parse_args()
    json_path, markdown_path = output_paths(args, "slow_loader")
    quiet_lightning()
    settings = QUICK if args.quick else FULL
    batches = data(settings)
    batch_kib = sum(t.numel() * t.element_size() for t in batches[0][0].values()) / 1024
    env = environment({
        **asdict(settings), "devices": DEVICES, "accumulate": ACCUMULATE, "num_workers": WORKERS,
        "load_ms_per_batch": LOAD_SECONDS * 1e3, "compute_ms_per_micro_batch": COMPUTE_SECONDS * 1e3,
        "batch": f"{ROWS} rows × {LENGTH} tokens, {batch_kib:.0f} KiB", "backend": "gloo, fork",
        "model": "tests/_harness.py TokenModule + a sleep per training_step", "quick": args.quick,
    })
    started = time.perf_counter()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(settings.repeats):
            for method in METHODS:  # interleaved: load drift on a shared machine hits all three alike
                runs.append(timed_fit(method, repeat, batches, settings, Path(tmp)))
            elapsed = time.perf_counter() - started
            print(f"repetition {repeat + 1}/{settings.repeats} done ({elapsed:.0f} s)", flush=True)
    rows = summarize(runs)
    by_method = {row["method"]: row for row in rows}
    ratios = {f"wait_ratio_{m}": by_method[m]["wait_ratio_median"] for m in ("lookahead", "deferred")}
    verdict = all(value <= TARGET for value in ratios.values())
    headers = [
        "method", "data wait ms / step", "ratio to plain (median)", "step ms", "step ratio", "first window wait ms",
        "end-of-stream next ms", "most batches held", "peak RSS MiB", "RSS growth MiB",
    ]
    body = [
        [
            r["method"], f"{r['wait_ms_per_step']:.1f}", f"{r['wait_ratio_median']:.3f}", f"{r['step_ms']:.0f}",
            f"{r['step_ratio_median']:.3f}", f"{r['first_window_wait_ms']:.0f}",
            f"{r['end_of_stream_ms']:.0f}", r["most_held"],
            f"{r['peak_rss_mib']:.0f}", f"{r['rss_growth_mib']:.1f}",
        ]
        for r in rows
    ]
    look = by_method["lookahead"]
    memory_line = (
        f"Lookahead held at most {look['most_held']} batches between the loader and `training_step`"
        f" ({look['most_held'] * batch_kib / 1024:.2f} MiB of {batch_kib:.0f} KiB batches; K = {ACCUMULATE}),"
        f" plain DDP {by_method['plain']['most_held']}, deferred {by_method['deferred']['most_held']}; peak RSS"
        f" {look['peak_rss_mib']:.0f} MiB against {by_method['plain']['peak_rss_mib']:.0f} MiB for plain DDP."
    )
    markdown = "\n\n".join([
        "### Slow loader: data wait per optimizer step against plain DDPStrategy (2 gloo processes)",
        environment_markdown(env),
        f"{settings.repeats} interleaved repetitions; each fit: 1 warm-up window + {settings.timed_steps} timed"
        f" optimizer steps of K = {ACCUMULATE}; loader: {WORKERS} workers, {LOAD_SECONDS * 1e3:.0f} ms per batch;"
        f" {COMPUTE_SECONDS * 1e3:.0f} ms of pretended compute per micro-batch. Data wait = time in the loader"
        " iterator's `__next__` per step (rank 0), the call that finds the end of the epoch apart (it shuts the"
        " workers down; plain DDP trusts `len()` and pays that later, outside `__next__`); ratio = paired with plain"
        " DDP's in the same repetition.",
        markdown_table(headers, body),
        f"{'PASS' if verdict else 'FAIL'}: data wait per step, lookahead / plain ="
        f" {ratios['wait_ratio_lookahead']:.3f}, deferred / plain = {ratios['wait_ratio_deferred']:.3f}"
        f" (target ≤ {TARGET:.2f}).",
        memory_line,
    ])
    payload = {**ratios, "target": TARGET, "pass": verdict, "environment": env, "rows": rows,
               "runs": [asdict(run) for run in runs]}
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
