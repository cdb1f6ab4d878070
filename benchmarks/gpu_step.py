"""GPU step time as a user sees it: lookahead and deferred mode against plain ``DDPStrategy`` on a GPT-2-small-sized
decoder-only LM, in a host-bound and a device-bound regime, in one launch.

One process per GPU (Lightning's subprocess launcher, NCCL), ``accumulate_grad_batches=4``, ``bf16-mixed``, AdamW. The
model is built here in plain torch: 12 layers, width 768, 12 heads, vocabulary 32,000, context 512, tied embeddings
(110M parameters). Each micro-batch holds random sequences with a masked prompt and right padding of random lengths
(up to half the context each), so the count of target tokens differs from micro-batch to micro-batch and rank to
rank. Two regimes (``--micro-batch-sizes``): 8 rows per micro-batch (the host's launch work is the step's bound on an
H200) and 32 rows (the device's). The batches are built once per process before the timed fits and served from
(pinned) memory, so the loader never runs in lockstep with the step.

What is timed: each fit trains ``--warmup`` untimed and ``--steps`` timed optimizer steps; the timed region starts
after the warm-up's last step with ``torch.cuda.synchronize()`` and ends after the last step with another: no sync
inside it, so the host runs ahead of the device as in a user's run, and whatever the package makes the host wait for
shows. A CUDA event at every step's end gives the device's step times beside it. One repetition runs every regime
and method once (the methods' order rotated per repetition, the regimes' alternated); the repetitions go on until
``--repeats``, or until ``--budget`` seconds have passed once ``--min-repeats`` are done. Per regime and method: the
median over repetitions of the ratio of its timed region to plain DDP's in the same repetition, with the
distribution-free confidence interval of that median (order statistics, coverage at least 95 % where the
repetitions allow it, else the whole range and its coverage) and a bootstrap interval.

Host reads: before the timed fits, one short fit per method with ``tests/_sync.py``'s ``SyncWatch``
(``torch.cuda.set_sync_debug_mode("warn")``) counts the synchronizing CUDA operations per steady window, the
package's apart, and where each falls (inside a window, after its last backward before its optimizer step, after
the step began), and the count check's (once per fit, after the first window). It also warms up CUDA for the rest.

    python3 benchmarks/gpu_step.py            # every visible GPU, ~4 min on one H200 -> benchmarks/results/gpu_step.*
    python3 benchmarks/gpu_step.py --micro-batch-sizes 16 --repeats 9 --budget 600
    python3 benchmarks/gpu_step.py --quick    # CPU smoke run, < 1 min: tiny model, 2 gloo processes
    python3 benchmarks/gpu_step.py --json out.json --markdown out.md
    bash benchmarks/gpu_check.sh              # the GPU lane, then this (make gpu)

From the source tree: ``PYTHONPATH=src:tests:benchmarks``. Without CUDA it refuses to run (exit status 2), except with
``--quick``, which runs on the CPU (the sync watch rehearsing CUDA's syncs) and never writes ``benchmarks/results/``
(a temporary folder unless ``--json`` / ``--markdown`` say otherwise). The results are written after every
repetition, so a run stopped early leaves what it measured (``"complete": false``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    add_output_arguments,
    environment,
    environment_markdown,
    markdown_table,
    output_paths,
    quiet_lightning,
    write_results,
)
from _sync import SyncWatch, per_window
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from token_mean import TokenMeanDDPStrategy

METHODS = ("plain", "lookahead", "deferred")
IGNORE_INDEX = -100  # what F.cross_entropy and the default count leave out
PAD = 0  # the input token at padded positions (never a target)
NO_CUDA_EXIT = 2
CONFIDENCE = 0.95  # the median's interval: the narrowest order-statistic one whose coverage reaches this
BOOTSTRAP = 10_000  # resamples of the ratios for the bootstrap interval
RESOLVED = 0.01  # "resolves 1 %": the interval's half-width at most this
TARGETS = {"host-bound": 1.03, "device-bound": 1.01}  # issue 44: ratio to plain DDP at most this, per regime
STEADY_WINDOW = 2  # the watch's windows from this one on: DDP rebuilt its buckets in the first
Batch = dict[str, Tensor]


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 32_000
    context: int = 512


GPT2_SMALL = ModelConfig()
TINY = ModelConfig(layers=2, width=64, heads=2, vocab=512, context=64)  # --quick


# ---------------------------------------------------------------------------------------------------------------
# the model: a pre-norm GPT-2-style decoder
# ---------------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.attention_norm = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.projection = nn.Linear(config.width, config.width)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.width)

    def forward(self, x: Tensor) -> Tensor:
        rows, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(rows, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention on CUDA in bf16
        x = x + self.projection(attended.transpose(1, 2).reshape(rows, length, width))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.vocab, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.embedding.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's initialization: N(0, 0.02), zero biases
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding(input_ids) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.norm(x))
        return logits


def parameter_count(config: ModelConfig) -> int:
    with torch.device("meta"):  # no memory, no initialization
        return sum(p.numel() for p in DecoderLM(config).parameters())


# ---------------------------------------------------------------------------------------------------------------
# the data: prompt-masked, right-padded random sequences, built once and served from memory
# ---------------------------------------------------------------------------------------------------------------


def micro_batch(config: ModelConfig, rows: int, rank: int, index: int) -> Batch:
    """``rows`` sequences of ``context`` tokens, each with a masked prompt and right padding of random lengths in
    [0, context / 2), so their target counts differ; drawn from a seed per (rank, index)."""
    context = config.context
    generator = torch.Generator().manual_seed(1_000_003 * rank + index)
    tokens = torch.randint(config.vocab, (rows, context + 1), generator=generator)
    prompt = torch.randint(0, context // 2, (rows, 1), generator=generator)
    padding = torch.randint(0, context // 2, (rows, 1), generator=generator)
    position = torch.arange(context)
    padded = position >= context - padding
    target = (position >= prompt) & ~padded
    return {
        "input_ids": tokens[:, :-1].masked_fill(padded, PAD),
        "labels": tokens[:, 1:].masked_fill(~target, IGNORE_INDEX),  # the next token, already shifted
    }


_BUILT: dict[tuple[int, int, int], list[Batch]] = {}  # (rows, rank, micro-batches) -> this process's batches


def batches_for(config: ModelConfig, rows: int, rank: int, count: int, pin: bool) -> list[Batch]:
    """One rank's micro-batches, built the first time a fit asks (the watch's fits come first, untimed) and kept:
    every later fit of every method trains on the very same tensors, pinned where they go to a GPU, so Lightning's
    copy to the device does not block the host."""
    key = (rows, rank, count)
    if key not in _BUILT:
        built = [micro_batch(config, rows, rank, index) for index in range(count)]
        _BUILT[key] = [{k: v.pin_memory() for k, v in batch.items()} for batch in built] if pin else built
    return _BUILT[key]


class InMemory(Dataset[Batch]):
    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        return self.batches[index]


@functools.cache
def count_statistics(config: ModelConfig, rows: int, micro_batches: int, ranks: int) -> dict[str, float]:
    counts = [
        int((micro_batch(config, rows, rank, index)["labels"] != IGNORE_INDEX).sum())
        for rank in range(ranks)
        for index in range(micro_batches)
    ]
    return {"min": min(counts), "median": statistics.median(counts), "max": max(counts),
            "mean": statistics.mean(counts), "tokens_per_micro_batch": rows * config.context}


# ---------------------------------------------------------------------------------------------------------------
# the module and the clock
# ---------------------------------------------------------------------------------------------------------------


class LMModule(pl.LightningModule):
    """``training_step`` returns the mean cross-entropy over its micro-batch's target tokens."""

    def __init__(self, config: ModelConfig, rows: int, micro_batches: int, pin: bool) -> None:
        super().__init__()
        self.config, self.rows, self.micro_batches, self.pin = config, rows, micro_batches, pin
        self.model: DecoderLM | None = None

    def configure_model(self) -> None:
        if self.model is None:  # under Lightning's init context: built on the device, the same weights every fit
            torch.manual_seed(0)
            self.model = DecoderLM(self.config)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        assert self.model is not None
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader[Batch]:
        batches = batches_for(self.config, self.rows, self.global_rank, self.micro_batches, self.pin)
        return DataLoader(InMemory(batches), batch_size=None)  # already pinned: nothing to do per batch


class StepClock(Callback):
    """The timed region: from the end of optimizer step ``warmup`` to the end of step ``warmup + steps``, each end
    after ``torch.cuda.synchronize()`` (the only syncs it adds); a CUDA event at every step's end, read after the
    fit; the peak device memory of the fit; N (the step's target tokens over all ranks) where the strategy
    publishes it."""

    def __init__(self, warmup: int, steps: int, cuda: bool) -> None:
        self.warmup, self.steps, self.cuda = warmup, steps, cuda
        self.region: list[float] = []  # perf_counter at the region's two ends
        self.ends: list[Any] = []  # per step: a CUDA event (perf_counter on the CPU)
        self.device_step_seconds: list[float] = []
        self.global_counts: list[float] = []
        self.peak_bytes = 0
        self._step = 0

    def _synchronized_now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self._step:
            return
        self._step = trainer.global_step
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.ends.append(event)
        else:
            self.ends.append(time.perf_counter())
        if self._step in (self.warmup, self.warmup + self.steps):
            self.region.append(self._synchronized_now())
        window = getattr(trainer.strategy, "last_window", None)
        if window is not None:
            self.global_counts.append(window.global_count)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        timed = self.ends[self.warmup - 1 : self.warmup + self.steps]  # the warm-up's last end, then each timed step's
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()
            self.device_step_seconds = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(timed)]
        else:
            self.device_step_seconds = [b - a for a, b in itertools.pairwise(timed)]


class Discard(Callback):
    """At the fit's end, drops the optimizer's state and the gradients: Lightning's teardown would otherwise copy
    them to the host (``Strategy.teardown`` moves optimizers and module to the CPU), about 1.3 GB a fit here."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.state.clear()
        pl_module.zero_grad(set_to_none=True)


@dataclass
class Fit:
    regime: str
    rows: int
    method: str
    repeat: int
    position: int  # where in its repetition's regime it ran (0: first)
    step_seconds: float  # the timed region over its steps, rank 0: what the user waits per step
    device_step_seconds: list[float]  # each timed step between CUDA events, rank 0
    fit_seconds: float  # the whole fit, set-up included
    peak_memory_gib: float  # rank 0's peak allocated device memory (0 on the CPU)
    global_counts: list[float] = field(default_factory=list)  # N of every step (token-mean methods)


# ---------------------------------------------------------------------------------------------------------------
# one launch, every regime and method
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    model: ModelConfig
    devices: int
    accelerator: str
    backend: str
    precision: str
    accumulate: int
    regimes: tuple[tuple[str, int], ...]  # (name, rows per micro-batch)
    warmup: int
    steps: int
    repeats: int
    min_repeats: int
    budget_seconds: float
    watch_steps: int  # the sync watch's fits: steps after its warm-up


def regimes_for(rows: list[int]) -> tuple[tuple[str, int], ...]:
    """8 and 32 rows are the host-bound and device-bound regimes of issue 44; other sizes are named by their rows."""
    names = {min(rows): "host-bound", max(rows): "device-bound"} if len(set(rows)) == 2 else {}
    return tuple((names.get(r, f"{r} rows"), r) for r in rows)


def trainer_for(method: str, settings: Settings, steps: int, callbacks: list[Callback]) -> pl.Trainer:
    if method == "plain":
        strategy: DDPStrategy = DDPStrategy(process_group_backend=settings.backend)
    else:
        strategy = TokenMeanDDPStrategy(mode=method, process_group_backend=settings.backend)  # type: ignore[arg-type]
    return pl.Trainer(
        accelerator=settings.accelerator, devices=settings.devices, strategy=strategy,
        precision=settings.precision,  # type: ignore[arg-type]
        accumulate_grad_batches=settings.accumulate, max_steps=steps, callbacks=[*callbacks, Discard()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )


def released(settings: Settings) -> None:
    """Every fit builds its own model and optimizer on the device: the last one's memory goes first."""
    gc.collect()
    if settings.accelerator == "gpu":
        torch.cuda.empty_cache()


def run_fit(method: str, settings: Settings, regime: tuple[str, int], repeat: int, position: int) -> Fit:
    steps = settings.warmup + settings.steps
    cuda = settings.accelerator == "gpu"
    clock = StepClock(settings.warmup, settings.steps, cuda)
    trainer = trainer_for(method, settings, steps, [clock])
    module = LMModule(settings.model, regime[1], steps * settings.accumulate, cuda)
    started = time.perf_counter()
    trainer.fit(module)
    fit_seconds = time.perf_counter() - started
    if len(clock.region) != 2 or len(clock.device_step_seconds) != settings.steps:
        raise RuntimeError(f"{method}: the timed region did not close ({len(clock.ends)} steps of {steps} ended)")
    fit = Fit(
        regime[0], regime[1], method, repeat, position, (clock.region[1] - clock.region[0]) / settings.steps,
        clock.device_step_seconds, fit_seconds, clock.peak_bytes / 2**30, clock.global_counts,
    )
    del trainer, module, clock
    released(settings)
    return fit


def watch_fit(method: str, settings: Settings, regime: tuple[str, int]) -> dict[str, Any]:
    """One short fit under the sync watch: the package's host reads per steady window and where they fall, and
    everyone's (Lightning, torch, the model) for comparison."""
    steps = STEADY_WINDOW + settings.watch_steps
    watch = SyncWatch(rehearse=settings.accelerator != "gpu")
    trainer = trainer_for(method, settings, steps, [watch])
    trainer.fit(LMModule(settings.model, regime[1], steps * settings.accumulate, settings.accelerator == "gpu"))
    record = watch.record()
    del trainer, watch
    released(settings)
    return {
        "method": method, "regime": regime[0], "rows": regime[1], "steps": steps,
        "window_lengths": record["window_lengths"],
        "package": per_window(record, STEADY_WINDOW, "token_mean"),
        "everyone": per_window(record, STEADY_WINDOW, None),
    }


def rotated(repeat: int) -> list[str]:
    """The methods in the order repetition ``repeat`` runs them: each method runs first as often as the others."""
    shift = repeat % len(METHODS)
    return [*METHODS[shift:], *METHODS[:shift]]


def agreed(keep_going: bool) -> bool:
    """Rank 0's decision, on every rank: each rank runs every fit, so they must stop after the same repetition."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return keep_going
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    decision = torch.tensor([int(keep_going)], device=device)
    dist.broadcast(decision, src=0)
    return bool(decision.item())


# ---------------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------------


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values``: (x_(k), x_(n+1-k)) of the sorted values, with the
    largest k whose coverage 1 - 2·P(B <= k - 1), B ~ Binomial(n, 1/2), is at least ``confidence``; (min, max) and
    its coverage where no k reaches it.

    Example:
        >>> median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # n = 7: only (min, max) reaches 95 %
        (1.0, 7.0, 0.984375)
        >>> median_interval([float(x) for x in range(9)])  # n = 9: the second smallest and largest, 96.1 %
        (1.0, 7.0, 0.9609375)
    """
    ordered, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def bootstrap_interval(values: list[float], confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the median (``BOOTSTRAP`` resamples, seeded)."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(BOOTSTRAP))
    tail = (1 - confidence) / 2
    return medians[int(tail * (BOOTSTRAP - 1))], medians[int((1 - tail) * (BOOTSTRAP - 1))]


def verdict(low: float, high: float, target: float | None) -> str:
    if target is None:
        return "—"
    if high <= target:
        return f"met (≤ {target})"
    if low > target:
        return f"missed (> {target})"
    return f"not resolved against {target}"


def summarize(fits: list[Fit], settings: Settings, counts: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    rows = []
    for regime, micro_rows in settings.regimes:
        mine = [fit for fit in fits if fit.regime == regime]
        plain = {fit.repeat: fit.step_seconds for fit in mine if fit.method == "plain"}
        tokens_per_step = settings.accumulate * settings.devices * counts[regime]["tokens_per_micro_batch"]
        for method in METHODS:
            fits_of = [fit for fit in mine if fit.method == method and fit.repeat in plain]
            if not fits_of:
                continue
            ratios = [fit.step_seconds / plain[fit.repeat] for fit in fits_of]
            steps = [fit.step_seconds for fit in fits_of]
            device_steps = [s for fit in fits_of for s in fit.device_step_seconds]
            low, high, coverage = median_interval(ratios)
            boot_low, boot_high = bootstrap_interval(ratios)
            median = statistics.median(steps)
            target = TARGETS.get(regime) if method != "plain" else None
            rows.append({
                "regime": regime, "rows": micro_rows, "method": method, "repeats": len(fits_of),
                "median_step_ms": median * 1e3, "step_ms_min": min(steps) * 1e3, "step_ms_max": max(steps) * 1e3,
                "median_device_step_ms": statistics.median(device_steps) * 1e3,
                "ratio_median": statistics.median(ratios), "ratios": ratios,
                "ratio_interval": [low, high], "ratio_interval_coverage": coverage,
                "ratio_bootstrap_interval": [boot_low, boot_high],
                "resolved_to_1_percent": (high - low) / 2 <= RESOLVED,
                "target": target, "verdict": verdict(low, high, target),
                "tokens_per_second": tokens_per_step / median,
                "peak_memory_gib": max(fit.peak_memory_gib for fit in fits_of),
            })
    return rows


# ---------------------------------------------------------------------------------------------------------------
# the report (rank 0)
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def gpu_environment() -> dict[str, Any]:
    """The devices, the CUDA stack and, where present, nvidia-smi's view of them."""
    info: dict[str, Any] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if not info["available"]:
        return info
    properties = [torch.cuda.get_device_properties(index) for index in range(torch.cuda.device_count())]
    info.update({
        "count": len(properties),
        "names": [p.name for p in properties],
        "memory_gib": [round(p.total_memory / 2**30, 1) for p in properties],
        "multiprocessors": [p.multi_processor_count for p in properties],
        "capability": [f"{p.major}.{p.minor}" for p in properties],
        "cudnn": torch.backends.cudnn.version(),
        "nccl": _version(torch.cuda.nccl.version()),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    })
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            query = "index,name,driver_version,memory.total,power.limit,clocks.max.sm,pci.bus_id"
            completed = subprocess.run(
                [smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
            lines = completed.stdout.strip().splitlines()
            info["nvidia_smi"] = {"query": query, "rows": lines} if completed.returncode == 0 else completed.stderr
            if completed.returncode == 0 and lines:
                info["driver"] = lines[0].split(",")[2].strip()
            topology = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
            info["nvidia_smi_topology"] = topology.stdout if topology.returncode == 0 else None
        except (OSError, subprocess.SubprocessError) as error:  # the numbers matter more than the driver's name
            info["nvidia_smi"] = f"{type(error).__name__}: {error}"
    return info


def _version(version: Any) -> str:
    return ".".join(str(part) for part in version) if isinstance(version, tuple | list) else str(version)


def step_table(rows: list[dict[str, Any]]) -> str:
    headers = ["regime", "method", "step (ms, median)", "step range (ms)", "device step (ms)", "ratio to plain",
               "interval (coverage)", "bootstrap 95 %", "± 1 %?", "target", "tokens/s", "peak GiB"]
    body = []
    for r in rows:
        plain = r["method"] == "plain"
        low, high = r["ratio_interval"]
        boot_low, boot_high = r["ratio_bootstrap_interval"]
        body.append([
            f"{r['regime']} ({r['rows']} rows)", r["method"], f"{r['median_step_ms']:.1f}",
            f"{r['step_ms_min']:.1f}–{r['step_ms_max']:.1f}", f"{r['median_device_step_ms']:.1f}",
            "1" if plain else f"**{r['ratio_median']:.4f}**",
            "—" if plain else f"{low:.4f}–{high:.4f} ({r['ratio_interval_coverage']:.1%})",
            "—" if plain else f"{boot_low:.4f}–{boot_high:.4f}",
            "—" if plain else ("yes" if r["resolved_to_1_percent"] else "no"),
            r["verdict"], f"{r['tokens_per_second']:,.0f}", f"{r['peak_memory_gib']:.2f}",
        ])
    return markdown_table(headers, body)


def reads_table(watched: list[dict[str, Any]]) -> str:
    headers = ["method", "all syncs / steady window", "the package's / steady window", "where the package's fall",
               "the count check (once per fit)"]
    body = []
    for w in watched:
        package, everyone = w["package"], w["everyone"]
        where = "; ".join(f"{count:g} × {place}" for place, count in package["per_window_by_where"].items()) or "—"
        checks = package["count_checks"]
        check = "—" if not checks else "; ".join(
            f"after window {c['window']}, before step {c['steps'] + 1}: {c['replays']} replays, {c['syncs']} syncs"
            for c in checks
        )
        body.append([w["method"], f"{everyone['per_window']:g}", f"{package['per_window']:g}", where, check])
    return markdown_table(headers, body)


def report(
    fits: list[Fit], watched: list[dict[str, Any]], settings: Settings, quick: bool, paths: tuple[Path, Path],
    wall_seconds: float, complete: bool, stopped_by: str,
) -> None:
    micro_batches = (settings.warmup + settings.steps) * settings.accumulate  # what each rank trains per fit
    counts = {
        regime: count_statistics(settings.model, rows, micro_batches, settings.devices)
        for regime, rows in settings.regimes
    }
    repeats = len({fit.repeat for fit in fits})
    configuration = {
        "model": {**asdict(settings.model), "parameters": parameter_count(settings.model), "tied_embeddings": True,
                  "architecture": "pre-norm GPT-2-style decoder in plain torch, SDPA causal attention, GELU MLP 4x"},
        "devices": settings.devices, "accelerator": settings.accelerator, "backend": settings.backend,
        "launcher": "Lightning subprocess launcher, one process per device; every fit in the same processes",
        "precision": settings.precision, "accumulate_grad_batches": settings.accumulate,
        "regimes": [{"name": name, "micro_batch_rows": rows} for name, rows in settings.regimes],
        "optimizer": "AdamW(lr=3e-4, weight_decay=0.1)", "warmup_steps": settings.warmup,
        "timed_steps": settings.steps, "repeats_asked": settings.repeats, "min_repeats": settings.min_repeats,
        "budget_seconds": None if math.isinf(settings.budget_seconds) else settings.budget_seconds,
        "repeats_done": repeats, "stopped_by": stopped_by,
        "order": "one launch; per repetition every regime (alternating first) and method (order rotated)",
        "timing": "rank 0; torch.cuda.synchronize() and perf_counter at the timed region's two ends only; a CUDA"
                  " event at every step's end (device step times)",
        "ratio": "per repetition and regime: the method's timed region / plain DDP's; median over repetitions,"
                 f" order-statistic interval of the median (coverage >= {CONFIDENCE:.0%} where n allows) and a"
                 f" percentile bootstrap ({BOOTSTRAP} resamples)",
        "loader": "batches built once per process before the timed fits, pinned, served from memory"
                  " (DataLoader over a list, batch_size=None, no workers)",
        "count_check": "on (the default): three forwards without gradient per micro-batch of every fit's first"
                       " window (warm-up)",
        "sync_watch": f"one fit per method, {STEADY_WINDOW} + {settings.watch_steps} steps, tests/_sync.py SyncWatch;"
                      f" per window over windows {STEADY_WINDOW}.. (rehearsed on the CPU without CUDA)",
        "data": "random tokens; per row a masked prompt and right padding, each uniform in [0, context/2)",
        "target_tokens_per_micro_batch": counts, "targets": TARGETS, "quick": quick,
    }
    env = {**environment(configuration), "gpu": gpu_environment()}
    rows = summarize(fits, settings, counts)
    payload: dict[str, Any] = {
        "environment": env, "complete": complete, "rows": rows, "host_reads": watched,
        "fits": [asdict(fit) for fit in fits], "wall_seconds": wall_seconds,
        **{
            f"ratio_{row['method']}_{row['regime']}": row["ratio_median"]
            for row in rows if row["method"] != "plain"
        },
    }
    gpu = env["gpu"]
    hardware = (
        f"{gpu['count']} × {gpu['names'][0]} ({gpu['memory_gib'][0]} GiB), driver {gpu.get('driver', 'unknown')},"
        f" CUDA {gpu['torch_cuda']}, NCCL {gpu['nccl']}" if gpu["available"] else "no GPU: CPU smoke run (--quick)"
    )
    model = settings.model
    regimes = ", ".join(
        f"{name}: {rows} rows per micro-batch, target tokens {counts[name]['min']:.0f}–{counts[name]['max']:.0f}"
        f" (median {counts[name]['median']:.0f} of {counts[name]['tokens_per_micro_batch']:.0f})"
        for name, rows in settings.regimes
    )
    status = "" if complete else f" **Incomplete: stopped after {repeats} repetitions ({stopped_by}).**"
    markdown = "\n\n".join([
        f"# GPU step time: token-mean DDP against plain DDPStrategy ({settings.devices} × {settings.accelerator},"
        f" K = {settings.accumulate})",
        environment_markdown(env) + f" · {hardware}",
        f"Decoder LM, {configuration['model']['parameters'] / 1e6:.1f}M parameters ({model.layers} layers,"
        f" width {model.width}, {model.heads} heads, vocabulary {model.vocab}, context {model.context}),"
        f" {settings.precision}, AdamW, {settings.backend}; {regimes}. {repeats} repetitions of"
        f" {settings.warmup} warm-up + {settings.steps} timed optimizer steps per regime and method, in one"
        " launch, the methods' order rotated per repetition; batches built before the fits and served from pinned"
        " memory. Step = the timed region (synchronized at its two ends only) over its steps; device step ="
        " between CUDA events at the steps' ends. Ratio = a fit's step / plain DDP's in the same repetition and"
        " regime (< 1 is faster): the median over repetitions, the distribution-free interval of that median (its"
        f" coverage in brackets) and a bootstrap interval; ± 1 %: the interval's half-width ≤ {RESOLVED}. Targets"
        f" (issue 44): ratio ≤ {TARGETS['host-bound']} host-bound, ≤ {TARGETS['device-bound']} device-bound, met"
        f" when the whole interval is below.{status}",
        step_table(rows),
        "## Host reads: synchronizing CUDA operations per steady window"
        if gpu["available"]
        else "## Host reads, rehearsed on the CPU (reads where a CUDA tensor would synchronize)",
        f"One fit per method ({watched[0]['regime'] if watched else '—'}), windows {STEADY_WINDOW} onwards, counted"
        " with `torch.cuda.set_sync_debug_mode(\"warn\")` (tests/_sync.py); the package's are those whose innermost"
        " frame outside torch is in `token_mean`. A read after a window's last backward makes the host wait for"
        " the device before it queues the optimizer step.",
        reads_table(watched),
    ])
    json_path, markdown_path = paths
    write_results(json_path, markdown_path, payload, markdown)
    if not complete:
        print(f"repetition {repeats} done in {wall_seconds:.0f} s: partial results in {json_path}", flush=True)
        return
    print(markdown)
    print(json.dumps({key: value for key, value in payload.items() if key.startswith("ratio_")}))
    print(f"wrote {json_path} and {markdown_path} in {wall_seconds:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "gpu_step")  # --quick: tiny model, 2 CPU processes with gloo (< 1 min)
    parser.add_argument("--devices", type=int, help="processes, one per GPU (default: every visible GPU)")
    parser.add_argument("--accumulate", type=int, default=4, help="accumulate_grad_batches, K")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[8, 32],
                        help="sequences per micro-batch, one regime each (8: host-bound, 32: device-bound)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per fit")
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per fit")
    parser.add_argument("--repeats", type=int, default=15, help="at most this many repetitions")
    parser.add_argument("--min-repeats", type=int, default=7, help="at least this many, whatever the budget")
    parser.add_argument("--budget", type=float, default=195.0,
                        help="seconds: no new repetition once it would end past this (after --min-repeats)")
    parser.add_argument("--watch-steps", type=int, default=4, help="steady steps of the sync watch's fits")
    args = parser.parse_args()
    if args.quick:
        torch.set_num_threads(1)  # 2 processes share the CPU's cores
        settings = Settings(TINY, args.devices or 2, "cpu", "gloo", "bf16-mixed", args.accumulate,
                            regimes_for([2, 4]), 1, 2, 2, 2, math.inf, 2)
    else:
        if not torch.cuda.is_available():
            print(
                f"gpu_step.py measures CUDA step times, but torch {torch.__version__} sees no CUDA device (CUDA build:"
                f" {torch.version.cuda}). Run it on a machine with a GPU and a CUDA build of torch, or pass --quick"
                " for a CPU smoke run (tiny model, gloo) that records nothing.",
                file=sys.stderr,
            )
            sys.exit(NO_CUDA_EXIT)
        if args.warmup < 1 or args.steps < 1 or args.min_repeats < 1:
            parser.error("--warmup, --steps and --min-repeats must be at least 1")
        settings = Settings(
            GPT2_SMALL, args.devices or torch.cuda.device_count(), "gpu", "nccl", "bf16-mixed", args.accumulate,
            regimes_for(args.micro_batch_sizes), args.warmup, args.steps, max(args.repeats, args.min_repeats),
            args.min_repeats, args.budget, args.watch_steps,
        )
    quiet_lightning()
    paths = output_paths(args, "gpu_step")
    started = time.perf_counter()
    # the sync watch first: its fits also build the batches and warm CUDA up (kernels, cuBLAS, the allocator)
    watched = [watch_fit(method, settings, settings.regimes[0]) for method in METHODS]
    rank_zero = not dist.is_initialized() or dist.get_rank() == 0  # every rank runs every fit; rank 0 reports
    fits: list[Fit] = []
    stopped_by, longest = "--repeats", 0.0
    for repeat in range(settings.repeats):
        began = time.perf_counter()
        regimes = settings.regimes if repeat % 2 == 0 else settings.regimes[::-1]
        for regime in regimes:
            for position, method in enumerate(rotated(repeat)):
                fits.append(run_fit(method, settings, regime, repeat, position))
        longest = max(longest, time.perf_counter() - began)
        done = repeat + 1
        over_budget = time.perf_counter() - started + longest > settings.budget_seconds
        keep_going = agreed(done < settings.repeats and (done < settings.min_repeats or not over_budget))
        if done < settings.repeats and not keep_going:
            stopped_by = f"--budget {settings.budget_seconds:g} s"
        if rank_zero:  # after every repetition: a run stopped from outside leaves what it measured
            elapsed = time.perf_counter() - started
            report(fits, watched, settings, args.quick, paths, elapsed, not keep_going, stopped_by)
        if not keep_going:
            break
    if dist.is_initialized():
        dist.destroy_process_group()  # before the interpreter finalizes


if __name__ == "__main__":
    main()
