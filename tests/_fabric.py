"""A LitGPT-shaped Fabric loop over the harness's token model, plain and with ``TokenMeanAccumulator``.

The model predicts each position's label from the features one position earlier, as a causal LM does: the loss is
``logits[:, :-1]`` against ``labels[:, 1:]``, computed in the loop, and its count is ``count_shifted_labels``.
``plain_loop`` is LitGPT's accumulation (``fabric.backward(loss / K)`` inside ``no_backward_sync``), the control that
must miss; ``accumulator_loop`` is the same loop with the five lines changed. ``reference`` is the float64
unpartitioned objective both are compared with. Workers are forked: Fabric's ``DDPStrategy(start_method="fork")``,
and ``ModelParallelStrategy`` (which only has the subprocess launcher) with Fabric's fork launcher swapped in
(:func:`forked_model_parallel`). Each rank reads its own list of batches, or (``loader="sized"``, ``"unsized"``) a
``DataLoader`` over them that ``fabric.setup_dataloaders`` set up, as LitGPT's loaders are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import (
    IGNORE_INDEX,
    SHORT_TIMEOUT,
    Batch,
    ListDataset,
    StreamDataset,
    TokenNet,
    initial_state,
    lightning_steps,
    make_optimizer,
    ragged_batches,
    reference_steps,
)
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader

GLOO: dict[str, Any] = {"process_group_backend": "gloo"}
LOADERS = ("list", "sized", "unsized")
Observe = Callable[[Iterable[Batch]], Iterable[Batch]]  # wraps what the loop iterates (the cost counter's cycles)


def shifted_loss(net: nn.Module, batch: Batch, reduction: str = "mean") -> Tensor:
    """LitGPT's loss shape: the logits of position t score the label of position t + 1 (ignore_index -100).

    ``"mean"`` divides by the valid targets clamped to 1, as LitGPT's ``chunked_cross_entropy`` does, so a
    micro-batch without a target gives 0, not 0/0.
    """
    logits = net(batch["x"])[:, :-1]
    targets = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def shifted_count(batch: Batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def reference(
    data: Sequence[Sequence[Batch]], accumulate: int, epochs: int = 1
) -> tuple[dict[str, Tensor], list[float]]:
    """The float64 unpartitioned objective over the loops' windows (K per rank, a short last one): the final
    parameters and each step's N, the shifted loss counted by ``shifted_count`` (imports nothing from token_mean)."""
    return reference_steps(
        lightning_steps(data, accumulate, epochs), loss_sum=lambda net, batch: shifted_loss(net, batch, "sum"),
        count=shifted_count,
    )


class _ForkedModelParallel(ModelParallelStrategy):
    def _configure_launcher(self) -> None:
        self._launcher = _MultiProcessingLauncher(self, start_method="fork")


def forked_model_parallel(data_parallel: int, tensor_parallel: int) -> ModelParallelStrategy:
    """Fabric's ``ModelParallelStrategy`` (FSDP2 over the data-parallel ranks, tensor parallelism over the others)
    on forked workers."""
    return _ForkedModelParallel(
        parallelize_fn=parallelize, data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel, **GLOO
    )


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mesh["tensor_parallel"].size() > 1:
        parallelize_module(model, mesh["tensor_parallel"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def fabric_for(layout: str, devices: int = 2, tensor_parallel: int = 1) -> Fabric:
    """``"ddp"`` (forked), ``"fsdp"`` (FSDP2 × tensor parallelism, forked) or ``"single"``."""
    if layout == "single":
        return Fabric(accelerator="cpu", devices=1)
    if layout == "ddp":
        strategy: Any = DDPStrategy(start_method="fork", **GLOO)
    else:
        strategy = forked_model_parallel(devices // tensor_parallel, tensor_parallel)
    return Fabric(accelerator="cpu", devices=devices, strategy=strategy)


def forked_ranks() -> Fabric:
    """Two forked gloo processes whose collectives time out after 15 s (a rank left alone fails, not the suite)."""
    strategy = DDPStrategy(start_method="fork", timeout=SHORT_TIMEOUT, **GLOO)
    return Fabric(accelerator="cpu", devices=2, strategy=strategy)


def every_rank(result: Any) -> list[Any]:
    """Every rank's ``result`` (small picklable values), in rank order, over the default group."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def subgroups(fabric: Fabric) -> dict[str, Any]:
    """A process group of this rank alone, and one of both ranks (another object than the default group). Every rank
    creates every group in the same order: ``new_group`` is a collective over the default group."""
    alone = [dist.new_group([rank]) for rank in range(fabric.world_size)]
    return {"own": alone[fabric.global_rank], "both": dist.new_group(list(range(fabric.world_size)))}


def ragged(ranks: int, batches: int, seed: int) -> list[list[Batch]]:
    """Ragged per-rank batches of at least two positions (a shifted loss needs one target position)."""
    data = ragged_batches(ranks, batches, seed=seed)
    for rank in data:
        for index, batch in enumerate(rank):
            if batch["x"].shape[1] < 2:
                rank[index] = {key: value.repeat(1, 2, *([1] * (value.dim() - 2))) for key, value in batch.items()}
    return data


def data_rank(fabric: Fabric) -> int:
    """The rank whose batches this process reads: the data-parallel rank (tensor-parallel peers read the same)."""
    mesh = getattr(fabric.strategy, "_device_mesh", None)
    return fabric.global_rank if mesh is None else int(mesh["data_parallel"].get_local_rank())


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole parameters on the CPU (a DTensor's shards gathered: a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    return {
        name.removeprefix("_forward_module.").removeprefix("module."): (
            value.full_tensor() if isinstance(value, DTensor) else value
        ).detach().cpu().clone()
        for name, value in model.state_dict().items()
    }


def rank_batches(fabric: Fabric, data: Sequence[Sequence[Batch]], loader: str = "list") -> Iterable[Batch]:
    """This rank's batches: the list itself, or a ``DataLoader`` over a ``Dataset`` (``"sized"``; ``"workers"``:
    made in 2 persistent worker processes) or an ``IterableDataset`` (``"unsized"``) of them, through
    ``fabric.setup_dataloaders`` (no sampler: they are the rank's own already)."""
    batches = list(data[data_rank(fabric)])
    if loader == "list":
        return batches
    if loader not in (*LOADERS, "workers"):
        raise ValueError(f"`loader` must be one of {LOADERS} or 'workers', got {loader!r}.")
    dataset: Any = StreamDataset(batches) if loader == "unsized" else ListDataset(batches)
    workers: dict[str, Any] = {"num_workers": 2, "persistent_workers": True} if loader == "workers" else {}
    return fabric.setup_dataloaders(DataLoader(dataset, batch_size=None, **workers), use_distributed_sampler=False)


def setup(fabric: Fabric) -> tuple[Any, Any]:
    net = TokenNet()
    net.load_state_dict(initial_state())
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    return model, optimizer


def plain_loop(
    fabric: Fabric,
    data: Sequence[Sequence[Batch]],
    accumulate: int,
    epochs: int = 1,
    loss_fn: Callable[[nn.Module, Batch], Tensor] = shifted_loss,
    loader: str = "list",
    observe: Observe | None = None,
) -> dict[str, Tensor]:
    """LitGPT's loop: a mean of means (each rank steps every K batches and at its pass's last)."""
    model, optimizer = setup(fabric)
    batches = rank_batches(fabric, data, loader)
    length = len(data[data_rank(fabric)])
    for _ in range(epochs):
        for index, batch in enumerate(batches if observe is None else observe(batches)):
            accumulating = (index + 1) % accumulate != 0 and index + 1 != length
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(loss_fn(model, batch) / accumulate)
            if not accumulating:
                optimizer.step()
                optimizer.zero_grad()
    return full_state(model)


def accumulator_loop(
    fabric: Fabric,
    data: Sequence[Sequence[Batch]],
    accumulate: int,
    mode: str,
    epochs: int = 1,
    windows: list[dict[str, Any]] | None = None,
    loss_fn: Callable[[nn.Module, Batch], Tensor] = shifted_loss,
    loader: str = "list",
    observe: Observe | None = None,
    shape: str = "batches",
    **kwargs: Any,
) -> dict[str, Tensor]:
    """The same loop with ``TokenMeanAccumulator``; each finished window's stats go into ``windows``. ``shape``:
    ``"batches"`` is LitGPT's loop (``for batch in accumulator.batches(...)``), ``"windows"`` torchtitan's (``for
    window in accumulator.windows(...): for batch in window:``, then ``window.finish()``)."""
    from token_mean import count_shifted_labels
    from token_mean.fabric import TokenMeanAccumulator

    model, optimizer = setup(fabric)
    batches = rank_batches(fabric, data, loader)
    kwargs.setdefault("count_fn", count_shifted_labels)
    kwargs.setdefault("loss_fn", loss_fn)  # the count check replays it at the first window
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=accumulate, mode=mode, **kwargs)

    def step(stats: Any) -> None:
        if windows is not None:
            windows.append({**stats.__dict__, "rank_counts": list(stats.rank_counts or ())})
        if not stats.skipped:
            optimizer.step()
        optimizer.zero_grad()

    for _ in range(epochs):
        if shape == "windows":
            assert observe is None, "`observe` wraps the pass of `batches()`"
            for window in accumulator.windows(batches):
                for batch in window:
                    with fabric.no_backward_sync(model, enabled=window.accumulating):
                        accumulator.backward(loss_fn(model, batch))
                step(window.finish())
            continue
        one_pass = accumulator.batches(batches)
        for batch in one_pass if observe is None else observe(one_pass):
            with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
                accumulator.backward(loss_fn(model, batch))
            if not accumulator.accumulating:
                step(accumulator.finish())
    return full_state(model)


def launched(fabric: Fabric, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(fabric, *args, **kwargs)`` on every rank; rank 0's result.

    Tensors travel back as NumPy arrays: the fork launcher's queue shares a tensor's storage by file descriptor,
    which is gone once the worker has exited.
    """
    if fabric.strategy.__class__.__name__ == "SingleDeviceStrategy":
        return function(fabric, *args, **kwargs)
    return _tensors(fabric.launch(_as_arrays, function, *args, **kwargs))


def _as_arrays(fabric: Fabric, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(function(fabric, *args, **kwargs), Tensor, lambda tensor: tensor.numpy().copy())


def _tensors(result: Any) -> Any:
    import numpy as np
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(result, np.ndarray, torch.from_numpy)
