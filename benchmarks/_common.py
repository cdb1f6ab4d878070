"""What the benchmark scripts share: run metadata, forked gloo fits, a token-level model with ragged data, tables.

Not a benchmark itself. ``fidelity.py`` and ``overhead.py`` import it from their own directory.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from token_mean import TokenMeanDDPStrategy

ROOT = Path(__file__).resolve().parents[1]
# the example's model and corpus live in examples/, which is not a package
sys.path.insert(0, str(ROOT / "examples"))

METHODS = ("plain", "lookahead", "deferred")
IGNORE_INDEX = -100
# fork is ~0.2 s per fit against ~4 s for Lightning's subprocess launcher, which re-imports torch in every child
FORK: dict[str, Any] = {"start_method": "fork", "process_group_backend": "gloo"}
Batch = dict[str, Tensor]


def strategy_for(method: str) -> DDPStrategy:
    """Plain ``DDPStrategy`` or ``TokenMeanDDPStrategy`` in one of its modes, all forked gloo processes."""
    if method == "plain":
        return DDPStrategy(**FORK)
    return TokenMeanDDPStrategy(mode=method, **FORK)  # type: ignore[arg-type]


def environment(configuration: dict[str, Any]) -> dict[str, Any]:
    """Hardware, versions, date and configuration: recorded beside every number."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout
        commit += "+dirty src" if dirty.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "commit": commit,
        "torch_threads_per_process": torch.get_num_threads(),
        "configuration": configuration,
    }


def environment_markdown(env: dict[str, Any]) -> str:
    return (
        f"{env['date']} · {env['cpu']}, {env['cores']} cores · Python {env['python']}, torch {env['torch']},"
        f" lightning {env['lightning']} · commit {env['commit']} · {env['torch_threads_per_process']} torch thread"
        " per process"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# a token-level model and SFT-like ragged data: every micro-batch is (rows, length) tokens, prompts masked
# ---------------------------------------------------------------------------------------------------------------

FEATURES, HIDDEN, CLASSES = 8, 16, 11
ROWS = 4  # samples per micro-batch, as a fixed batch size gives
RAGGEDNESS = ("uniform", "sft", "extreme")


class TokenNet(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float64, seed: int = 1) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        # built in float64 and cast, so that both dtypes start from the same point as the float64 reference
        self.hidden = nn.Linear(FEATURES, HIDDEN, dtype=torch.float64)
        self.out = nn.Linear(HIDDEN, CLASSES, dtype=torch.float64)
        torch.random.set_rng_state(generator_state)
        self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def token_loss(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    """Cross-entropy over the valid tokens: their mean (what users return) or their sum."""
    logits: Tensor = net(batch["x"])
    return F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


def _micro_batch(generator: torch.Generator, prompts: list[int], responses: list[int]) -> Batch:
    """Right-padded rows of prompt + response tokens; only response positions are targets."""
    length = max(p + r for p, r in zip(prompts, responses, strict=True))
    x = torch.randn(len(prompts), length, FEATURES, generator=generator, dtype=torch.float64)
    labels = torch.full((len(prompts), length), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        labels[row, prompt : prompt + response] = torch.randint(0, CLASSES, (response,), generator=generator)
    return {"x": x, "labels": labels}


def _lengths(generator: torch.Generator, low: int, high: int, log_mean: float, log_std: float) -> list[int]:
    """ROWS log-normal lengths clipped to [low, high]: SFT responses run from one line to pages."""
    draws = torch.randn(ROWS, generator=generator, dtype=torch.float64) * log_std + log_mean
    return [int(min(max(round(float(torch.exp(d))), low), high)) for d in draws]


def ragged_data(raggedness: str, ranks: int, batches: int, seed: int = 0) -> list[list[Batch]]:
    """Per-rank micro-batches.

    - ``uniform``: every micro-batch holds 4 rows of 8 prompt and 8 response tokens (32 targets), so a mean of
      means equals the token mean and plain DDP must be exact too.
    - ``sft``: prompt-masked samples with log-normal prompt (median 12) and response (median 8, 1..64) lengths:
      micro-batch counts vary several-fold within and across ranks.
    - ``extreme``: ``sft``, but the last rank is nearly empty: one target token per micro-batch (with one rank,
      every other micro-batch). Never zero, so plain DDP's mean stays finite and its error can be shown.
    """
    if raggedness not in RAGGEDNESS:
        raise ValueError(f"`raggedness` must be one of {RAGGEDNESS}, got {raggedness!r}.")
    generator = torch.Generator().manual_seed(seed)
    data: list[list[Batch]] = []
    for rank in range(ranks):
        rank_batches: list[Batch] = []
        for index in range(batches):
            if raggedness == "uniform":
                prompts, responses = [8] * ROWS, [8] * ROWS
            else:
                prompts = _lengths(generator, 1, 48, 2.5, 0.6)
                responses = _lengths(generator, 1, 64, 2.1, 1.0)
                nearly_empty = rank == ranks - 1 if ranks > 1 else index % 2 == 1
                if raggedness == "extreme" and nearly_empty:
                    responses = [1] + [0] * (ROWS - 1)
            rank_batches.append(_micro_batch(generator, prompts, responses))
        data.append(rank_batches)
    return data


def cast(data: list[list[Batch]], dtype: torch.dtype) -> list[list[Batch]]:
    return [[{"x": b["x"].to(dtype), "labels": b["labels"]} for b in rank] for rank in data]


class ListDataset(Dataset[Batch]):
    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        return self.batches[index]


class TokenModule(pl.LightningModule):
    """What a user already has: ``training_step`` returns the masked mean loss of its micro-batch."""

    def __init__(self, data: list[list[Batch]], dtype: torch.dtype, lr: float, momentum: float) -> None:
        super().__init__()
        self.net = TokenNet(dtype)
        self.data = data
        self.lr = lr
        self.momentum = momentum

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return token_loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self) -> DataLoader[Batch]:
        # each rank its own share, already batched: the layout is chosen here, not by a sampler
        return DataLoader(ListDataset(self.data[self.global_rank]), batch_size=None)


def windows_of(batches: int, accumulate: int) -> Iterator[range]:
    """Lightning's stepping rule within one epoch: a step every K batches and on the last batch."""
    for start in range(0, batches, accumulate):
        yield range(start, min(start + accumulate, batches))


def reference(data: list[list[Batch]], accumulate: int, lr: float, momentum: float) -> dict[str, Tensor]:
    """The unpartitioned objective in float64: each step's loss is Σ over every valid token of every rank / N."""
    net = TokenNet(torch.float64)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    batches = min(len(rank) for rank in data)
    for window in windows_of(batches, accumulate):
        step_batches = [rank[i] for rank in data for i in window]
        total = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in step_batches)
        if total == 0:
            continue  # an empty step changes nothing
        optimizer.zero_grad()
        loss = torch.stack([token_loss(net, b, "sum") for b in step_batches]).sum() / total
        loss.backward()
        optimizer.step()
    return {f"net.{k}": v.detach() for k, v in net.state_dict().items()}


def relative_error(params: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """Largest per-tensor ‖p − p_ref‖ / ‖p_ref‖, computed in float64."""
    return max(float((params[k].double() - v).norm() / v.norm()) for k, v in expected.items())


# ---------------------------------------------------------------------------------------------------------------
# forked fits
# ---------------------------------------------------------------------------------------------------------------


class SaveParams(Callback):
    """Rank 0 saves the final parameters: forked workers cannot hand objects back to the parent."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            torch.save({k: v.detach().cpu() for k, v in pl_module.state_dict().items()}, self.path)


def fit(module: pl.LightningModule, method: str, devices: int, **trainer_kwargs: Any) -> None:
    """One ``Trainer.fit`` on ``devices`` forked gloo CPU processes; results travel through the callbacks' files."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy_for(method),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module)


def quiet_lightning() -> None:
    """Hundreds of fits would print hundreds of banners ("GPU available: False", "Initializing distributed...")."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*is smaller than the logging interval.*")
    warnings.filterwarnings("ignore", ".*an accumulation window had no valid items.*")
    # deprecations inside torch.distributed and Lightning 2.6.6 under torch 2.13, once per rank and fit
    warnings.filterwarnings("ignore", ".*all_gather_into_tensor` is deprecated.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
