"""The Fabric loop the accumulator tests share: forked Fabrics with a short process-group timeout, ragged data with a
valid shifted target in every batch, the float64 plain-torch reference, LitGPT's loop with the accumulator, and how a
test reads what every rank raised.

Workers are forked (Fabric's ``DDPStrategy`` and ``ModelParallelStrategy``, see ``_fabric.py``) with a 15 s
process-group timeout, so a rank left alone in a collective fails in seconds, not after 30 minutes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from _fabric import (
    GLOO,
    _ForkedModelParallel,
    data_rank,
    fabric_for,
    full_state,
    launched,
    parallelize,
    setup,
    shifted_count,
    shifted_loss,
)
from _harness import (
    IGNORE_INDEX,
    Batch,
    TokenNet,
    initial_state,
    lightning_steps,
    make_optimizer,
    ragged_batches,
    reference_steps,
    windows_of,
)
from _ranks import errors_of
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import Tensor

from token_mean import (
    DenominatorError,
    count_shifted_labels,
)
from token_mean.fabric import TokenMeanAccumulator

GLOO_TIMEOUT = timedelta(seconds=15)  # a rank left alone in a collective fails after this, not after 30 minutes
WAIT_FOR_RANKS = 25.0  # seconds a rank that raised waits for the others: longer than GLOO_TIMEOUT
POLL = 0.05
MISSES = 1e-6  # a control "misses" the reference by more than this
K = 2  # micro-batches per rank and window, unless a test says otherwise


# ---------------------------------------------------------------------------------------------------------------
# Fabrics, data, the reference
# ---------------------------------------------------------------------------------------------------------------


def ddp(**fabric_kwargs: Any) -> Fabric:
    """Two forked gloo processes under Fabric's ``DDPStrategy``."""
    strategy = DDPStrategy(start_method="fork", timeout=GLOO_TIMEOUT, **GLOO)
    return Fabric(accelerator="cpu", devices=2, strategy=strategy, **fabric_kwargs)


def model_parallel(devices: int = 2, tensor_parallel: int = 1, **fabric_kwargs: Any) -> Fabric:
    """FSDP2 over the data-parallel ranks, tensor parallelism over the others (``ModelParallelStrategy``), forked."""
    strategy = _ForkedModelParallel(
        parallelize_fn=parallelize, data_parallel_size=devices // tensor_parallel,
        tensor_parallel_size=tensor_parallel, timeout=GLOO_TIMEOUT, **GLOO,
    )
    return Fabric(accelerator="cpu", devices=devices, strategy=strategy, **fabric_kwargs)


FABRICS: dict[str, Callable[..., Fabric]] = {
    "ddp": ddp,
    "fsdp2": model_parallel,
    "fsdp2xtp": lambda **kwargs: model_parallel(4, 2, **kwargs),
}


def nonempty(batch: Batch) -> Batch:
    """The batch with at least two positions and one valid shifted target (a mean loss is then never 0/0)."""
    if batch["x"].shape[1] < 2:
        batch = {key: value.repeat(1, 2, *([1] * (value.dim() - 2))) for key, value in batch.items()}
    labels = batch["labels"].clone()
    if not (labels[:, 1:] != IGNORE_INDEX).any():
        labels[0, 1] = 1
    return {**batch, "labels": labels}


def ragged(ranks: int, batches: int, seed: int) -> list[list[Batch]]:
    """Ragged per-rank batches, per-rank mask rates far apart, every one with a valid shifted target."""
    return [[nonempty(batch) for batch in rank] for rank in ragged_batches(ranks, batches, seed=seed)]


def reference(data: Sequence[Sequence[Batch]], accumulate: int = K, epochs: int = 1) -> tuple[Any, list[float]]:
    """The float64 plain-torch run over Lightning's windows of ``data`` (imports nothing from token_mean)."""
    return reference_steps(
        lightning_steps(data, accumulate, epochs), loss_sum=lambda net, batch: shifted_loss(net, batch, "sum"),
        count=shifted_count,
    )


def trajectory(data: Sequence[Sequence[Batch]], accumulate: int = K) -> list[dict[str, Any]]:
    """The reference's windows, one pass: N, each rank's count, the exact loss before the update, the gradient norm
    before the update and the parameter norm after it (what a monitor's trace holds), in float64 plain torch."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    rows = []
    for window in windows_of(max(len(rank) for rank in data), accumulate):
        per_rank = [[rank[i] for i in window if i < len(rank)] for rank in data]
        rank_counts = [float(sum(shifted_count(b) for b in batches)) for batches in per_rank]
        total = sum(rank_counts)
        optimizer.zero_grad()
        loss = sum(shifted_loss(net, b, "sum") for batches in per_rank for b in batches) / total
        assert isinstance(loss, Tensor)
        loss.backward()
        grad_norm = math.sqrt(sum(float(p.grad.square().sum()) for p in net.parameters() if p.grad is not None))
        optimizer.step()
        param_norm = math.sqrt(sum(float(p.detach().square().sum()) for p in net.parameters()))
        rows.append({"global_count": total, "rank_counts": rank_counts, "loss": float(loss.detach()),
                     "grad_norm": grad_norm, "param_norm": param_norm})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# the loop (LitGPT's shape, tests/_fabric.py) and every rank's outcome
# ---------------------------------------------------------------------------------------------------------------

Step = Callable[[Any, Batch], dict[str, Any]]  # (model, batch) -> accumulator.backward's arguments


def loss_only(model: Any, batch: Batch) -> dict[str, Any]:
    return {"loss": shifted_loss(model, batch)}


def train(
    fabric: Fabric,
    data: Sequence[Sequence[Batch]],
    mode: str,
    accumulate: int = K,
    epochs: int = 1,
    step: Step = loss_only,
    **accumulator_kwargs: Any,
) -> dict[str, Any]:
    """The accumulator's loop; rank 0's final parameters, its windows' stats and its skipped windows."""
    model, optimizer = setup(fabric)
    accumulator_kwargs.setdefault("count_fn", count_shifted_labels)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=accumulate, mode=mode, **accumulator_kwargs)
    windows: list[dict[str, Any]] = []
    for _ in range(epochs):
        for batch in accumulator.batches(data[data_rank(fabric)]):
            with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
                accumulator.backward(**step(model, batch))
            if not accumulator.accumulating:
                stats = accumulator.finish()
                windows.append({**stats.__dict__, "rank_counts": list(stats.rank_counts or ())})
                if not stats.skipped:
                    optimizer.step()
                optimizer.zero_grad()
    return {"params": full_state(model), "windows": windows, "skipped": accumulator.skipped_steps}


def _recorded(fabric: Fabric, out: Path, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(fabric, ...)`` on this rank, writing what it raised (``error{rank}.txt``, ``notes{rank}.txt``) or
    ``done{rank}.txt``; a rank that raised waits (bounded) for every rank to finish or raise, then re-raises, since
    the fork launcher stops the other workers as soon as one has failed."""
    rank, ranks = fabric.global_rank, fabric.world_size
    try:
        result = function(fabric, *args, **kwargs)
    except BaseException as error:
        (out / f"error{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        (out / f"notes{rank}.txt").write_text("\n".join(getattr(error, "__notes__", ())))
        deadline = time.monotonic() + WAIT_FOR_RANKS
        settled = lambda r: (out / f"error{r}.txt").exists() or (out / f"done{r}.txt").exists()  # noqa: E731
        while time.monotonic() < deadline and not all(settled(r) for r in range(ranks)):
            time.sleep(POLL)
        raise
    (out / f"done{rank}.txt").write_text("")
    return result


def every_rank_raises(fabric: Fabric, out: Path, function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """Run ``function`` on every rank; it must raise on each: every rank's ``"ErrorType: message"``."""
    out.mkdir(parents=True, exist_ok=True)
    with pytest.raises(Exception):  # noqa: B017 - the launcher re-raises a worker's error as its own type
        launched(fabric, _recorded, out, function, *args, **kwargs)
    return errors_of(out, fabric.world_size)


def one_message(errors: list[str]) -> str:
    assert len(set(errors)) == 1, errors
    return errors[0]


def one_device(mode: str, accumulate: int = K) -> tuple[Fabric, Any, Any, TokenMeanAccumulator, list[Batch]]:
    fabric = fabric_for("single")
    model, optimizer = setup(fabric)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=accumulate, mode=mode, count_fn=count_shifted_labels)
    return fabric, model, optimizer, accumulator, ragged(1, 4, seed=47)[0]


def monitor_data(other: bool = False) -> list[list[Batch]]:
    """6 batches per rank (3 windows); ``other``: window 1 of rank 1 loses one target (another N from step 1 on)."""
    data = ragged(2, 6, seed=54)
    if other:
        labels = data[1][2]["labels"].clone()
        valid = (labels[:, 1:] != IGNORE_INDEX).nonzero()[0]
        labels[valid[0], valid[1] + 1] = IGNORE_INDEX
        data[1][2] = {**data[1][2], "labels": labels}
    return data


def validation_batches() -> list[Batch]:
    """5 validation batches, interleaved from two mask rates: the sampler gives rank 0 three well-filled batches and
    rank 1 two sparse ones."""
    rate_a, rate_b = ragged(2, 3, seed=55)
    return [batch for pair in zip(rate_a, [*rate_b[:2], None], strict=True) for batch in pair if batch is not None]


POISON = "poison"  # the key that marks the batch a count_fn or loss goes wrong on


def poisoned(window: int) -> list[list[Batch]]:
    """6 batches per rank; rank 1's first micro-batch of ``window`` is marked."""
    data = ragged(2, 6, seed=45)
    data[1][window * K] = {**data[1][window * K], POISON: torch.ones(())}
    return data


def guarded(fabric: Fabric, out: Path, data: list[list[Batch]], mode: str, count_fn: Any, step: Step) -> None:
    """The loop; at an error, each rank saves where it was (the iterator, a backward or a finish), how many optimizer
    steps it took and its parameters then."""
    model, optimizer = setup(fabric)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=K, mode=mode, count_fn=count_fn)
    where, steps = "batches", 0
    try:
        for batch in accumulator.batches(data[data_rank(fabric)]):
            where = "backward"
            with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
                accumulator.backward(**step(model, batch))
            if not accumulator.accumulating:
                where = "finish"
                accumulator.finish()
                optimizer.step()
                steps += 1
                optimizer.zero_grad()
            where = "batches"
    except DenominatorError:
        torch.save({"where": where, "steps": steps, "params": full_state(model)}, out / f"state{fabric.global_rank}.pt")
        raise
