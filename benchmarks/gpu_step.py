"""GPU step time: lookahead and deferred mode against plain ``DDPStrategy`` on a GPT-2-small-sized decoder-only LM.

One process per GPU (Lightning's subprocess launcher, NCCL), ``accumulate_grad_batches=4``, ``bf16-mixed``, AdamW. The
model is built here in plain torch: 12 layers, width 768, 12 heads, vocabulary 32,000, context 512, tied embeddings
(110M parameters). Each micro-batch holds 8 random sequences with a masked prompt and right padding of random lengths
(up to half the context each), so the count of target tokens differs from micro-batch to micro-batch and rank to rank.

All three methods are measured in one launch: every rank runs the same fits, plain, lookahead, deferred, with the
order rotated each repetition; each fit trains ``--warmup`` untimed and ``--steps`` timed optimizer steps, and a
callback stamps the end of every step after ``torch.cuda.synchronize()`` (one sync per step, the same for every
method). Per method: the median step time over its timed steps, and the median over repetitions of its ratio to
plain DDP in the same repetition.

    .venv/bin/python benchmarks/gpu_step.py                       # every visible GPU -> benchmarks/results/gpu_step.*
    .venv/bin/python benchmarks/gpu_step.py --devices 1 --micro-batch-size 16 --repeats 5
    .venv/bin/python benchmarks/gpu_step.py --quick               # CPU smoke run, < 1 min: tiny model, 2 gloo processes
    .venv/bin/python benchmarks/gpu_step.py --json out.json --markdown out.md

Without CUDA it refuses to run (exit status 2), except with ``--quick``, which runs on the CPU and never writes
``benchmarks/results/`` (a temporary folder unless ``--json`` / ``--markdown`` say otherwise).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
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
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from token_mean import TokenMeanDDPStrategy

METHODS = ("plain", "lookahead", "deferred")
IGNORE_INDEX = -100  # what F.cross_entropy and the default count leave out
PAD = 0  # the input token at padded positions (never a target)
NO_CUDA_EXIT = 2
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
# the data: prompt-masked, right-padded random sequences
# ---------------------------------------------------------------------------------------------------------------


class MaskedTokens(Dataset[Batch]):
    """One rank's micro-batches: ``rows`` sequences of ``context`` tokens, each with a masked prompt and right padding
    of random lengths in [0, context / 2), so their target counts differ. Drawn from a seed per (rank, index): every
    fit of every method sees the same batches."""

    def __init__(self, config: ModelConfig, rows: int, micro_batches: int, rank: int) -> None:
        self.config, self.rows, self.micro_batches, self.rank = config, rows, micro_batches, rank

    def __len__(self) -> int:
        return self.micro_batches

    def __getitem__(self, index: int) -> Batch:
        context = self.config.context
        generator = torch.Generator().manual_seed(1_000_003 * self.rank + index)
        tokens = torch.randint(self.config.vocab, (self.rows, context + 1), generator=generator)
        prompt = torch.randint(0, context // 2, (self.rows, 1), generator=generator)
        padding = torch.randint(0, context // 2, (self.rows, 1), generator=generator)
        position = torch.arange(context)
        padded = position >= context - padding
        target = (position >= prompt) & ~padded
        return {
            "input_ids": tokens[:, :-1].masked_fill(padded, PAD),
            "labels": tokens[:, 1:].masked_fill(~target, IGNORE_INDEX),  # the next token, already shifted
        }


def count_statistics(config: ModelConfig, rows: int, micro_batches: int, ranks: int) -> dict[str, float]:
    counts = [
        int((MaskedTokens(config, rows, micro_batches, rank)[index]["labels"] != IGNORE_INDEX).sum())
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

    def __init__(self, config: ModelConfig, rows: int, micro_batches: int, pin_memory: bool) -> None:
        super().__init__()
        self.config, self.rows, self.micro_batches, self.pin_memory = config, rows, micro_batches, pin_memory
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
        dataset = MaskedTokens(self.config, self.rows, self.micro_batches, self.global_rank)
        return DataLoader(dataset, batch_size=None, pin_memory=self.pin_memory)


class StepClock(Callback):
    """The end of every optimizer step, after the device finished it; the peak device memory of the fit; and N
    (the step's target tokens over all ranks) where the strategy publishes it."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.global_counts: list[float] = []
        self.peak_bytes = 0
        self._step = 0

    @staticmethod
    def _now(trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.stamps = [self._now(trainer)]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.stamps.append(self._now(trainer))
            window = getattr(trainer.strategy, "last_window", None)
            if window is not None:
                self.global_counts.append(window.global_count)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated()


@dataclass
class Fit:
    method: str
    repeat: int
    position: int  # where in its repetition it ran (0: first)
    step_seconds: list[float]  # each timed optimizer step, rank 0
    fit_seconds: float  # the whole fit, set-up included
    peak_memory_gib: float  # rank 0's peak allocated device memory (0 on the CPU)
    global_counts: list[float]  # N of every step (token-mean methods)


# ---------------------------------------------------------------------------------------------------------------
# one launch, every method
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    model: ModelConfig
    devices: int
    accelerator: str
    backend: str
    precision: str
    accumulate: int
    rows: int
    warmup: int
    steps: int
    repeats: int


def run_fit(method: str, settings: Settings, repeat: int, position: int) -> Fit:
    if method == "plain":
        strategy: DDPStrategy = DDPStrategy(process_group_backend=settings.backend)
    else:
        strategy = TokenMeanDDPStrategy(mode=method, process_group_backend=settings.backend)  # type: ignore[arg-type]
    steps = settings.warmup + settings.steps
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator=settings.accelerator, devices=settings.devices, strategy=strategy,
        precision=settings.precision,  # type: ignore[arg-type]
        accumulate_grad_batches=settings.accumulate, max_steps=steps, callbacks=[clock], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    module = LMModule(settings.model, settings.rows, steps * settings.accumulate, settings.accelerator == "gpu")
    started = time.perf_counter()
    trainer.fit(module)
    fit_seconds = time.perf_counter() - started
    stamps = clock.stamps[settings.warmup :]
    if len(stamps) != settings.steps + 1:
        raise RuntimeError(f"{method}: expected {settings.steps + 1} step ends after the warm-up, got {len(stamps)}")
    fit = Fit(
        method, repeat, position, [later - earlier for earlier, later in itertools.pairwise(stamps)],
        fit_seconds, clock.peak_bytes / 2**30, clock.global_counts,
    )
    del trainer, module, strategy, clock  # the next fit builds its own model and optimizer on the device
    gc.collect()
    if settings.accelerator == "gpu":
        torch.cuda.empty_cache()
    return fit


def rotated(repeat: int) -> list[str]:
    """The methods in the order repetition ``repeat`` runs them: each method runs first as often as the others."""
    shift = repeat % len(METHODS)
    return [*METHODS[shift:], *METHODS[:shift]]


# ---------------------------------------------------------------------------------------------------------------
# the report (rank 0)
# ---------------------------------------------------------------------------------------------------------------


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
    return info


def _version(version: Any) -> str:
    return ".".join(str(part) for part in version) if isinstance(version, tuple | list) else str(version)


def summarize(fits: list[Fit], settings: Settings, counts: dict[str, float]) -> list[dict[str, Any]]:
    plain = {fit.repeat: statistics.median(fit.step_seconds) for fit in fits if fit.method == "plain"}
    tokens_per_step = settings.accumulate * settings.devices * counts["tokens_per_micro_batch"]
    targets_per_step = settings.accumulate * settings.devices * counts["mean"]
    rows = []
    for method in METHODS:
        mine = [fit for fit in fits if fit.method == method]
        steps = [seconds for fit in mine for seconds in fit.step_seconds]
        ratios = [statistics.median(fit.step_seconds) / plain[fit.repeat] for fit in mine]
        median = statistics.median(steps)
        rows.append({
            "method": method,
            "median_step_ms": median * 1e3,
            "step_ms_min": min(steps) * 1e3, "step_ms_max": max(steps) * 1e3,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": ratios,
            "tokens_per_second": tokens_per_step / median,
            "target_tokens_per_second": targets_per_step / median,
            "peak_memory_gib": max(fit.peak_memory_gib for fit in mine),
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["method", "median step (ms)", "step range (ms)", "ratio to plain (median)", "ratio range",
               "tokens/s (all ranks)", "peak memory rank 0 (GiB)"]
    body = [
        [r["method"], f"{r['median_step_ms']:.1f}", f"{r['step_ms_min']:.1f}–{r['step_ms_max']:.1f}",
         "1" if r["method"] == "plain" else f"{r['ratio_median']:.3f}",
         "—" if r["method"] == "plain" else f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f}",
         f"{r['tokens_per_second']:,.0f}", f"{r['peak_memory_gib']:.2f}"]
        for r in rows
    ]
    return markdown_table(headers, body)


def report(fits: list[Fit], settings: Settings, args: argparse.Namespace, wall_seconds: float) -> None:
    micro_batches = (settings.warmup + settings.steps) * settings.accumulate  # what each rank trains per fit
    counts = count_statistics(settings.model, settings.rows, micro_batches, settings.devices)
    configuration = {
        "model": {**asdict(settings.model), "parameters": parameter_count(settings.model), "tied_embeddings": True,
                  "architecture": "pre-norm GPT-2-style decoder in plain torch, SDPA causal attention, GELU MLP 4x"},
        "devices": settings.devices, "accelerator": settings.accelerator, "backend": settings.backend,
        "launcher": "Lightning subprocess launcher, one process per device", "precision": settings.precision,
        "accumulate_grad_batches": settings.accumulate, "micro_batch_rows": settings.rows,
        "optimizer": "AdamW(lr=3e-4, weight_decay=0.1)", "warmup_steps": settings.warmup,
        "timed_steps": settings.steps, "repeats": settings.repeats,
        "order": "one launch; methods interleaved, order rotated each repetition",
        "timing": "rank 0, torch.cuda.synchronize() then perf_counter at the end of every optimizer step",
        "data": "random tokens; per row a masked prompt and right padding, each uniform in [0, context/2)",
        "target_tokens_per_micro_batch": counts, "quick": args.quick,
    }
    env = {**environment(configuration), "gpu": gpu_environment()}
    rows = summarize(fits, settings, counts)
    by_method = {row["method"]: row for row in rows}
    payload = {
        "environment": env, "rows": rows, "fits": [asdict(fit) for fit in fits], "wall_seconds": wall_seconds,
        **{f"ratio_{method}": by_method[method]["ratio_median"] for method in METHODS[1:]},
    }
    gpu = env["gpu"]
    hardware = (
        f"{gpu['count']} × {gpu['names'][0]} ({gpu['memory_gib'][0]} GiB), driver {gpu.get('driver', 'unknown')},"
        f" CUDA {gpu['torch_cuda']}, NCCL {gpu['nccl']}" if gpu["available"] else "no GPU: CPU smoke run (--quick)"
    )
    model = settings.model
    markdown = "\n\n".join([
        f"# GPU step time: token-mean DDP against plain DDPStrategy ({settings.devices} × {settings.accelerator},"
        f" K = {settings.accumulate})",
        environment_markdown(env) + f" · {hardware}",
        f"Decoder LM, {configuration['model']['parameters'] / 1e6:.1f}M parameters ({model.layers} layers, width"
        f" {model.width}, {model.heads} heads, vocabulary {model.vocab}, context {model.context}), {settings.rows}"
        f" rows per micro-batch, {settings.precision}, AdamW, {settings.backend}; target tokens per micro-batch"
        f" {counts['min']:.0f}–{counts['max']:.0f} (median {counts['median']:.0f} of"
        f" {counts['tokens_per_micro_batch']:.0f}). {settings.repeats} repetitions of {settings.warmup} warm-up +"
        f" {settings.steps} timed optimizer steps per method, in one launch, order rotated per repetition. Ratio ="
        " median step time of the method's fit / plain DDP's fit of the same repetition (< 1 is faster); its median"
        " and range over repetitions.",
        table(rows),
    ])
    json_path, markdown_path = output_paths(args, "gpu_step")
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(json.dumps({key: value for key, value in payload.items() if key.startswith("ratio_")}))
    print(f"wrote {json_path} and {markdown_path} in {wall_seconds:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "gpu_step")  # --quick: tiny model, 2 CPU processes with gloo (< 1 min)
    parser.add_argument("--devices", type=int, help="processes, one per GPU (default: every visible GPU)")
    parser.add_argument("--accumulate", type=int, default=4, help="accumulate_grad_batches, K")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps per fit")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per fit")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of plain/lookahead/deferred")
    args = parser.parse_args()
    if args.quick:
        torch.set_num_threads(1)  # 2 processes share the CPU's cores
        settings = Settings(TINY, args.devices or 2, "cpu", "gloo", "bf16-mixed", args.accumulate, 2, 1, 2, 1)
    else:
        if not torch.cuda.is_available():
            print(
                f"gpu_step.py measures CUDA step times, but torch {torch.__version__} sees no CUDA device (CUDA build:"
                f" {torch.version.cuda}). Run it on a machine with a GPU and a CUDA build of torch, or pass --quick"
                " for a CPU smoke run (tiny model, gloo) that records nothing.",
                file=sys.stderr,
            )
            sys.exit(NO_CUDA_EXIT)
        settings = Settings(
            GPT2_SMALL, args.devices or torch.cuda.device_count(), "gpu", "nccl", "bf16-mixed", args.accumulate,
            args.micro_batch_size, args.warmup, args.steps, args.repeats,
        )
    quiet_lightning()
    started = time.perf_counter()
    fits = [
        run_fit(method, settings, repeat, position)
        for repeat in range(settings.repeats)
        for position, method in enumerate(rotated(repeat))
    ]
    distributed = torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:  # every rank ran every fit; rank 0 reports
        report(fits, settings, args, time.perf_counter() - started)
    if distributed:
        torch.distributed.destroy_process_group()  # before the interpreter finalizes


if __name__ == "__main__":
    main()
