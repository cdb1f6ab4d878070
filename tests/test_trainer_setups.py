"""The Trainer's setups: every training setup Lightning accepts (loaders, samplers, ``None`` batches, K schedules,
resumes, SWA, length hints) is exact under the strategy, or refused with the same clear error on every rank.

One section per setup. A supported setup is compared with the plain-torch float64 reference over the optimizer steps
that Lightning's own stepping rule makes of the same per-rank batches (relative error < 1e-12), next to a plain
``DDPStrategy`` control that must miss wherever plain DDP's mean of means differs. A refused setup must raise a clear
error on every rank: each forked worker records what it raised (``_ranks.outcomes_recorded``), and the test reads
every rank's message. Every fit runs through ``_harness.fit`` with a ``SHORT_TIMEOUT`` process group, so that a rank
left alone in a collective fails within the test's time limit.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _harness import (
    CLASSES,
    EXACT,
    FEATURES,
    MODES,
    SHORT_TIMEOUT,
    Batch,
    ListDataset,
    StreamDataset,
    TokenModule,
    fit,
    lightning_steps,
    make_batch,
    params_of,
    ragged_batches,
    reference_steps,
    relative_error,
    strategy_for,
    summary_of,
    token_loss,
    windows_of,
)
from _monitor_helpers import logged
from _ranks import raises_everywhere
from _resume_helpers import PositionLoader, ResumableModule, checkpoint_at, fit_checkpointed
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from token_mean import (
    DenominatorMonitor,
    ExactDistributedSampler,
    TokenMeanDDPStrategy,
    TokenMeanLoss,
    count_valid_labels,
)

MISSES = 1e-6  # a plain-DDP control "misses" the reference by more than this
NO_CHECK = {mode: {"check_count": False} for mode in MODES}  # for a training_step that records every call it gets


# ---------------------------------------------------------------------------------------------------------------
# comparing a run's final parameters with the float64 reference (``_harness.reference_steps``), and the data
# ---------------------------------------------------------------------------------------------------------------


def assert_exact(params: dict[str, Tensor], expected: dict[str, Tensor], what: str = "") -> None:
    error = relative_error(params, expected)
    assert error < EXACT, f"{what}relative parameter error {error:.3e}"


def assert_misses(params: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    error = relative_error(params, expected)
    assert error > MISSES, f"plain DDP matched the token mean ({error:.3e}): the test could not fail"


def matches_or_misses(mode: str, params: dict[str, Tensor], windows: list[dict[str, Any]],
                      expected: dict[str, Tensor], counts: list[float]) -> None:
    """The strategy's run is exact, window by window; plain DDP's (the control) misses."""
    if mode == "plain":
        assert_misses(params, expected)
        return
    assert_exact(params, expected)
    assert [window["global_count"] for window in windows] == counts


def nonempty(batch: Batch) -> Batch:
    """The batch with at least one valid target, so that a mean loss is never 0/0."""
    labels = batch["labels"].clone()
    if not (labels != -100).any():
        labels.view(-1)[0] = 1
    return {**batch, "labels": labels}


def ragged(ranks: int, batches: int, seed: int) -> list[list[Batch]]:
    return [[nonempty(b) for b in rank] for rank in ragged_batches(ranks, batches, seed=seed)]


# ---------------------------------------------------------------------------------------------------------------
# several training loaders (Lightning's CombinedLoader)
#
# Lightning: the combined batch is a dict (or list) of sub-batches. `max_size_cycle` (the default) runs as long as the
# longest loader and restarts a shorter one with a new `iter()` mid-epoch (here loader "b" of 3 batches restarts at
# batch 3, inside window [2, 3]); `min_size` stops with the shortest; `max_size` runs as long as the longest and gives
# None for an exhausted loader.
# ---------------------------------------------------------------------------------------------------------------

SUB_LOADERS = {"a": 5, "b": 3}  # batches per rank of each loader


def parts_of(batch: Any) -> list[Batch]:
    """The sub-batches of a combined batch exactly as `training_step` receives it (None: an exhausted loader)."""
    if isinstance(batch, dict) and set(batch) == set(SUB_LOADERS):
        parts = list(batch.values())
    elif isinstance(batch, list) and len(batch) == len(SUB_LOADERS):
        parts = batch
    else:
        keys = sorted(batch) if isinstance(batch, dict) else len(batch) if isinstance(batch, list) else None
        raise TypeError(f"not the combined batch: a {type(batch).__name__} ({keys})")
    return [part for part in parts if part is not None]


def merge(parts: list[Batch]) -> Batch:
    """The sub-batches' tokens as one sequence: the per-token model gives the same loss sum."""
    x = torch.cat([part["x"].reshape(-1, FEATURES) for part in parts]).unsqueeze(0)
    labels = torch.cat([part["labels"].reshape(-1) for part in parts]).unsqueeze(0)
    return {"x": x, "labels": labels}


def count_combined(batch: Any) -> int:
    return sum(int((part["labels"] != -100).sum()) for part in parts_of(batch))


class SeveralLoaders(TokenModule):
    def __init__(self, loaders: dict[str, list[list[Batch]]], shape: str, combined_mode: str | None) -> None:
        super().__init__([[]])
        self.loaders = loaders
        self.shape = shape
        self.combined_mode = combined_mode
        self.returned: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return token_loss(self.net, merge(parts_of(batch)))

    def train_dataloader(self) -> Any:
        rank = self.global_rank
        loaders = {name: DataLoader(ListDataset(data[rank]), batch_size=None) for name, data in self.loaders.items()}
        self.returned = loaders if self.shape == "dict" else list(loaders.values())
        if self.combined_mode is None:
            return self.returned
        return CombinedLoader(self.returned, self.combined_mode)


def several_loaders_data(seed: int = 31) -> dict[str, list[list[Batch]]]:
    return {name: ragged(2, length, seed + index) for index, (name, length) in enumerate(SUB_LOADERS.items())}


def combined_per_rank(loaders: dict[str, list[list[Batch]]], combined_mode: str) -> list[list[Batch]]:
    """What each rank's `training_step` sees as Lightning's CombinedLoader yields it, merged into one batch."""
    per_rank = []
    for rank in range(2):
        sources = [loaders[name][rank] for name in SUB_LOADERS]
        lengths = [len(source) for source in sources]
        steps = min(lengths) if combined_mode == "min_size" else max(lengths)
        per_rank.append([
            merge([
                source[i % len(source)] if combined_mode == "max_size_cycle" else source[i]
                for source in sources
                if combined_mode == "max_size_cycle" or i < len(source)
            ])
            for i in range(steps)
        ])
    return per_rank


SEVERAL = [  # (train_dataloader returns a dict or a list, CombinedLoader mode or None: Lightning's default)
    ("dict", None),
    ("list", None),
    ("dict", "min_size"),
    ("dict", "max_size"),
    ("list", "max_size"),
]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize(("shape", "combined_mode"), SEVERAL, ids=[f"{s}-{m or 'default'}" for s, m in SEVERAL])
def test_several_training_loaders(tmp_path: Path, mode: str, shape: str, combined_mode: str | None) -> None:
    """Exact over the combined batches; `count_fn` raises unless it gets the combined batch `training_step` gets."""
    if mode == "plain" and (shape, combined_mode) != ("dict", None):
        pytest.skip("one plain-DDP control is enough")
    loaders = several_loaders_data()
    kwargs = {} if mode == "plain" else {"count_fn": count_combined}
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT, **kwargs)
    params, _ = fit(SeveralLoaders(loaders, shape, combined_mode), strategy, tmp_path, accumulate_grad_batches=2,
                    max_epochs=2)
    per_rank = combined_per_rank(loaders, combined_mode or "max_size_cycle")
    expected, _ = reference_steps(lightning_steps(per_rank, 2, epochs=2))
    if mode == "plain":
        assert_misses(params, expected)
    else:
        assert_exact(params, expected)


# ---------------------------------------------------------------------------------------------------------------
# ExactDistributedSampler under Lightning's default use_distributed_sampler=True
# ---------------------------------------------------------------------------------------------------------------


def items(count: int, seed: int = 41) -> list[Batch]:
    """One sequence of 4 tokens per item, with its id; mask rates differ from item to item."""
    generator = torch.Generator().manual_seed(seed)
    batches = [nonempty(make_batch(generator, 1, 4, keep=0.95 - 0.06 * i)) for i in range(count)]
    return [{"x": b["x"][0], "labels": b["labels"][0], "id": torch.tensor(i)} for i, b in enumerate(batches)]


def item_shards(dataset: list[Batch], batch_size: int = 2) -> list[list[Batch]]:
    """Rank r trains items r, r + 2, ... in batches of two: each item exactly once."""
    shards = []
    for rank in range(2):
        mine = dataset[rank::2]
        shards.append([
            {key: torch.stack([item[key] for item in mine[start : start + batch_size]]) for key in mine[0]}
            for start in range(0, len(mine), batch_size)
        ])
    return shards


class SampledModule(TokenModule):
    def __init__(self, dataset: list[Batch], out: Path) -> None:
        super().__init__([[]])
        self.dataset = dataset
        self.out = out
        self.seen: list[int] = []

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        if not getattr(self.trainer.strategy, "is_filler_batch", False):
            self.seen.extend(batch["id"].tolist())
        return token_loss(self.net, batch)

    def on_train_end(self) -> None:
        (self.out / f"seen{self.global_rank}.json").write_text(json.dumps(self.seen))

    def train_dataloader(self) -> DataLoader[Batch]:
        sampler = ExactDistributedSampler(self.dataset, shuffle=False)  # type: ignore[arg-type]
        return DataLoader(self.dataset, batch_size=2, sampler=sampler)  # type: ignore[arg-type]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("count", [12, 13], ids=["even", "uneven"])
def test_exact_sampler_with_lightnings_default(tmp_path: Path, mode: str, count: int) -> None:
    """Lightning must not wrap and re-shard the sampler: every item once per epoch, and the exact objective."""
    if mode == "plain" and count == 13:
        pytest.skip("plain DDP cannot run ranks of different lengths: the control uses the even split")
    dataset = items(count)
    # training_step records the items it sees: the count check's replays would add three (check_count=False)
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT, **NO_CHECK.get(mode, {}))
    params, _ = fit(SampledModule(dataset, tmp_path), strategy, tmp_path, accumulate_grad_batches=2,
                    use_distributed_sampler=True)
    expected, _ = reference_steps(lightning_steps(item_shards(dataset), 2))
    if mode == "plain":
        assert_misses(params, expected)
        return
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in range(2)]
    assert seen == [list(range(0, count, 2)), list(range(1, count, 2))], "items trained by rank 0 and rank 1"
    assert_exact(params, expected)


# ---------------------------------------------------------------------------------------------------------------
# reload_dataloaders_every_n_epochs: each epoch's loaders anew, of another length (uneven ranks in epoch 0)
# ---------------------------------------------------------------------------------------------------------------


class ReloadedModule(TokenModule):
    """Epoch e trains ``epochs[e][rank]``: Lightning calls ``train_dataloader`` again at every epoch."""

    def __init__(self, epochs: list[list[list[Batch]]], iterable: bool) -> None:
        super().__init__(epochs[0], iterable=iterable)
        self.epochs = epochs

    def train_dataloader(self) -> DataLoader[Batch]:
        self.data = self.epochs[self.current_epoch]
        return super().train_dataloader()


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_loaders_reloaded_every_epoch(tmp_path: Path, mode: str, iterable: bool) -> None:
    """Epoch 0: 5 and 3 batches (fillers on rank 1), epoch 1: 4 and 4, epoch 2: 3 and 3, with K = 2: each epoch's
    windows are those of its own loaders, agreed anew. Control: plain DDP misses (its means of means; epoch 0 even
    there, 5 and 5: uneven ranks leave its collectives out of step)."""
    data = ragged_batches(2, 12, seed=181)
    first = 5 if mode == "plain" else 3
    epochs = [[data[0][:5], data[1][:first]], [data[0][5:9], data[1][5:9]], [data[0][9:], data[1][9:]]]
    module = ReloadedModule(epochs, iterable)
    params, windows = fit(module, strategy_for(mode), tmp_path, accumulate_grad_batches=2, max_epochs=3,
                          reload_dataloaders_every_n_epochs=1)
    steps = [step for epoch in epochs for step in lightning_steps(epoch, 2)]
    expected, counts = reference_steps(steps)
    matches_or_misses(mode, params, windows, expected, counts)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_overfit_batches(tmp_path: Path, mode: str) -> None:
    """`overfit_batches=3`: every epoch trains each rank's first 3 batches (windows [0, 1], [2]). Control: plain DDP
    misses."""
    data = ragged_batches(2, 6, seed=183)
    params, windows = fit(TokenModule(data), strategy_for(mode), tmp_path, accumulate_grad_batches=2, max_epochs=2,
                          overfit_batches=3)
    expected, counts = reference_steps(lightning_steps([rank[:3] for rank in data], 2, epochs=2))
    matches_or_misses(mode, params, windows, expected, counts)


class Validated(TokenModule):
    """Validates on its own training batches (forward only, the loss logged with `sync_dist`, a collective)."""

    out: Path  # where rank 0 notes after which batch each validation ran

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.log("val_loss", token_loss(self.net, batch), sync_dist=True, batch_size=1)

    def on_validation_start(self) -> None:  # after which batch (rank 0 notes it)
        if self.global_rank == 0 and not self.trainer.sanity_checking:
            with (self.out / "validated.txt").open("a") as file:
                file.write(f"{self.trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1}\n")

    def val_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(ListDataset(self.data[self.global_rank][:2]), batch_size=None)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_validation_inside_windows(tmp_path: Path, mode: str, iterable: bool) -> None:
    """`val_check_interval=2` with K = 3: validations after batches 1, 3 and 5 run inside windows (and the
    lookahead's batches read ahead wait through them). Control: plain DDP misses."""
    data = ragged_batches(2, 7, seed=184)
    module = Validated(data, iterable=iterable)
    module.out = tmp_path
    params, windows = fit(module, strategy_for(mode), tmp_path, accumulate_grad_batches=3, val_check_interval=2,
                          limit_val_batches=2, check_val_every_n_epoch=None if iterable else 1)
    assert (tmp_path / "validated.txt").read_text().split()[:3] == ["1", "3", "5"]
    expected, counts = reference_steps(lightning_steps(data, 3))
    matches_or_misses(mode, params, windows, expected, counts)


class WithWorkers(TokenModule):
    """Batches made in DataLoader worker processes (shared memory), pinned, the workers kept across epochs or not."""

    persistent = False

    def train_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(ListDataset(self.data[self.global_rank]), batch_size=None, num_workers=2,
                          persistent_workers=self.persistent, pin_memory=self.persistent)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_loader_workers(tmp_path: Path, mode: str, persistent: bool) -> None:
    """Two worker processes per rank, two epochs, uneven ranks for the strategy (5 and 4 batches; 5 and 5 for plain
    DDP, whose collectives uneven ranks leave out of step). Control: plain DDP misses."""
    data = ragged_batches(2, 5, seed=185)
    if mode != "plain":
        data[1] = data[1][:4]
    module = WithWorkers(data)
    module.persistent = persistent
    params, windows = fit(module, strategy_for(mode), tmp_path, accumulate_grad_batches=2, max_epochs=2)
    expected, counts = reference_steps(lightning_steps(data, 2, epochs=2))
    matches_or_misses(mode, params, windows, expected, counts)


class Checkpointed(TokenModule):
    """Activation checkpointing (non-reentrant, torch's recommended form): the hidden layer's forward runs again in
    the backward."""

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        hidden = checkpoint(lambda x: torch.tanh(self.net.hidden(x)), batch["x"], use_reentrant=False)
        logits = self.net.out(hidden)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_activation_checkpointing(tmp_path: Path, mode: str) -> None:
    data = ragged_batches(2, 5, seed=186)
    params, windows = fit(Checkpointed(data), strategy_for(mode), tmp_path, accumulate_grad_batches=2)
    expected, counts = reference_steps(lightning_steps(data, 2))
    matches_or_misses(mode, params, windows, expected, counts)


# ---------------------------------------------------------------------------------------------------------------
# stopping inside a window (`trainer.should_stop`, as `EarlyStopping` and `Timer` set it): Lightning ends the epoch
# after the batch, and the partial window is never stepped (plain DDP's gradient is dropped there too)
# ---------------------------------------------------------------------------------------------------------------


class StopAt(Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1 == self.batch:
            trainer.should_stop = True  # on every rank, as EarlyStopping and Timer decide it


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_should_stop_inside_a_window(tmp_path: Path, mode: str, iterable: bool) -> None:
    """K = 3, stopped after batch 4 (inside window [3, 5]): one step, the first window's, then a clean end with a
    checkpoint. Control: plain DDP's one step misses."""
    data = ragged_batches(2, 8, seed=182)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    params, windows = fit(TokenModule(data, iterable=iterable), strategy_for(mode), tmp_path,
                          accumulate_grad_batches=3, callbacks=[StopAt(4), checkpoints], enable_checkpointing=True)
    assert summary_of(tmp_path)["global_step"] == 1
    expected, counts = reference_steps(lightning_steps(data, 3)[:1])
    matches_or_misses(mode, params, windows, expected, counts)
    if mode == "plain":
        return
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["token_mean"]["inside_window"].startswith("the accumulation window of optimizer step 1")  # refused


# ---------------------------------------------------------------------------------------------------------------
# a loader that refills one batch buffer in place
#
# The stream is sized: for an unsized loader Lightning itself fetches one batch ahead, which overwrites the buffer
# before `training_step` runs even under plain DDP.
# ---------------------------------------------------------------------------------------------------------------


class RefilledBuffer(IterableDataset[Batch]):
    """Yields the same tensors every time, refilled in place (pinned ring buffers, some streaming readers)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        buffer = {key: torch.empty_like(value) for key, value in self.batches[0].items()}
        for batch in self.batches:
            for key, value in batch.items():
                buffer[key].copy_(value)
            yield buffer

    def __len__(self) -> int:
        return len(self.batches)


class BufferModule(TokenModule):
    def train_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(RefilledBuffer(self.data[self.global_rank]), batch_size=None)


def same_shape_batches(seed: int = 51) -> list[list[Batch]]:
    """6 batches of 2 × 4 tokens per rank with very different numbers of valid targets."""
    generator = torch.Generator().manual_seed(seed)
    keeps = ((0.95, 0.2, 0.6, 0.9, 0.3, 0.7), (0.3, 0.9, 0.15, 0.5, 0.95, 0.4))
    return [[nonempty(make_batch(generator, 2, 4, keep)) for keep in rank] for rank in keeps]


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_buffer_refilled_in_place(tmp_path: Path, mode: str) -> None:
    """Deferred is exact; lookahead reads the first window's 3 batches ahead into the one buffer, so it refuses on
    every rank before any update, pointing to `mode='deferred'`; plain DDP misses. Never silently wrong."""
    data = same_shape_batches()
    expected, _ = reference_steps(lightning_steps(data, 3))
    if mode == "lookahead":
        messages = raises_everywhere(tmp_path, lambda: fit(BufferModule(data), strategy_for(mode,
                                     timeout=SHORT_TIMEOUT), tmp_path, accumulate_grad_batches=3))
        for message in messages:
            assert message.startswith("DenominatorError") and "refills one buffer in place" in message, message
            assert "mode='deferred'" in message, message
        return
    params, _ = fit(BufferModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path,
                    accumulate_grad_batches=3)
    if mode == "plain":
        assert_misses(params, expected)
    else:
        assert_exact(params, expected, f"{mode} finished: ")


class LateRefill(IterableDataset[Batch]):
    """A stream that yields fresh tensors twice, then refills the last batch's tensors in place: deferred mode reads
    one batch past a stream's window before its last backward, into the memory of the batch in flight."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        last: Batch = {}
        for index, batch in enumerate(self.batches):
            if index < 2:
                last = {key: value.clone() for key, value in batch.items()}
            else:
                for key, value in batch.items():
                    last[key].copy_(value)
            yield last


class LateRefillModule(TokenModule):
    def train_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(LateRefill(self.data[self.global_rank]), batch_size=None)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_stream_that_refills_the_batch_in_flight_is_refused_in_deferred_mode(tmp_path: Path) -> None:
    """The read past window [0, 1] overwrites batch 1 before its backward: refused on every rank before the update,
    naming the fix (fresh tensors) and the batch; never a gradient of another batch."""
    messages = raises_everywhere(tmp_path, lambda: fit(LateRefillModule(same_shape_batches()), strategy_for(
        "deferred", timeout=SHORT_TIMEOUT), tmp_path, accumulate_grad_batches=2))
    assert messages[0] == messages[1], messages
    first, fix = messages[0].splitlines()[:2]
    assert first.startswith("DenominatorError: token_mean: ranks 0, 1: a batch read ahead shares memory with a batch"
                            " held or in flight"), first
    assert "optimizer step 0 (epoch 0, batches 0..1)" in first, first
    assert fix.strip().startswith("Fix: make the loader yield fresh tensors (`.clone()`)"), fix
    assert not (tmp_path / "params.pt").exists()


# ---------------------------------------------------------------------------------------------------------------
# a None batch
#
# Lightning (training_epoch_loop.advance) warns and runs no training_step for it, but still counts it as ready: it
# zeroes gradients at the first batch of a window (batch_idx % K == 0) and steps at the batch where ready % K == 0
# or the last one. A None at a window's stepping batch therefore makes no step, and the next window's first batch
# zeroes the gradient: that window is lost under plain DDP, and a None on one rank only leaves the ranks' backward
# passes out of step. Under the strategy a None batch is a zero-weight micro-batch (a filler): every rank trains the
# same positions, and every window steps on the valid items it holds.
# ---------------------------------------------------------------------------------------------------------------

NONE_CASES = [
    # (name, K, batches per rank, None cells (rank, batch), first batches of windows plain Lightning drops, epochs)
    ("inside-a-window-on-one-rank", 3, 6, [(1, 1)], [], 1),
    ("ends-a-window-on-every-rank", 3, 6, [(0, 2), (1, 2)], [0, 1, 2], 1),
    ("ends-the-epoch-on-every-rank", 2, 5, [(0, 4), (1, 4)], [4], 2),
]


class NoneModule(TokenModule):
    def train_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(ListDataset(self.data[self.global_rank]), batch_size=None)  # None passes through as is


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize(
    ("name", "k", "batches", "cells", "dropped", "epochs"), NONE_CASES, ids=[case[0] for case in NONE_CASES]
)
def test_none_batch(
    tmp_path: Path, mode: str, name: str, k: int, batches: int, cells: list[tuple[int, int]], dropped: list[int],
    epochs: int,
) -> None:
    if mode == "plain" and name != NONE_CASES[0][0]:
        pytest.skip("one plain-DDP control is enough")
    data: list[list[Any]] = [list(rank) for rank in ragged(2, batches, seed=61)]
    for rank, index in cells:
        data[rank][index] = None
    params, _ = fit(NoneModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path, accumulate_grad_batches=k,
                    max_epochs=epochs)
    # the strategy keeps every window (a None is a zero-weight micro-batch); plain Lightning drops some (see above)
    kept = [window for window in windows_of(batches, k) if mode != "plain" or window[0] not in dropped]
    steps = [
        [b for rank in data for i in window if (b := rank[i]) is not None] for _ in range(epochs) for window in kept
    ]
    expected, _ = reference_steps(steps)
    if mode == "plain":
        assert_misses(params, expected)
        return
    assert_exact(params, expected)
    assert summary_of(tmp_path)["global_step"] == len(steps)


# ---------------------------------------------------------------------------------------------------------------
# training_step(self, dataloader_iter): refused at fit start
# ---------------------------------------------------------------------------------------------------------------


class IteratorStep(TokenModule):
    def __init__(self, data: list[list[Batch]], out: Path) -> None:
        super().__init__(data)
        self.out = out

    def training_step(self, dataloader_iter: Iterator[Any]) -> Tensor:  # type: ignore[override]
        (self.out / f"trained{self.global_rank}.txt").write_text("")
        batch, _, _ = next(dataloader_iter)
        return token_loss(self.net, batch)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_dataloader_iter_is_refused_at_fit_start(tmp_path: Path, mode: str) -> None:
    module = IteratorStep(ragged(2, 4, seed=71), tmp_path)
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT)
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy, tmp_path, accumulate_grad_batches=2))
    for message in errors:
        assert "dataloader_iter" in message, message
    assert not list(tmp_path.glob("trained*.txt")), "training_step ran before the refusal"


# ---------------------------------------------------------------------------------------------------------------
# a callback that iterates trainer.train_dataloader mid-epoch
# ---------------------------------------------------------------------------------------------------------------


class PeekAtTheLoader(Callback):
    """Takes a sample batch from the training loader at batch 1 (to log it, say): harmless under plain DDP."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 1 and trainer.global_rank in self.ranks:
            next(iter(trainer.train_dataloader))  # type: ignore[call-overload]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("ranks", [(0, 1), (0,)], ids=["all-ranks", "rank-0"])
@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_callback_iterates_the_train_dataloader(
    tmp_path: Path, mode: str, ranks: tuple[int, ...], iterable: bool
) -> None:
    if mode == "plain" and (ranks, iterable) != ((0,), True):
        pytest.skip("one plain-DDP control is enough")
    data = ragged(2, 6, seed=81)
    params, _ = fit(TokenModule(data, iterable=iterable), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path,
                    accumulate_grad_batches=3, max_epochs=2, callbacks=[PeekAtTheLoader(ranks)])
    expected, _ = reference_steps(lightning_steps(data, 3, epochs=2))
    if mode == "plain":
        assert_misses(params, expected)
    else:
        assert_exact(params, expected)


# ---------------------------------------------------------------------------------------------------------------
# fillers: rank 0 has 5 batches, rank 1 has 3 and repeats a batch at weight zero for batches 3 and 4
# ---------------------------------------------------------------------------------------------------------------

FILLER_LENGTHS = (5, 3)
FILLER_K = 2


def filler_flag(trainer: pl.Trainer) -> Any:
    return getattr(trainer.strategy, "is_filler_batch", "missing")


class FillerModule(TokenModule):
    """Records `is_filler_batch` in training_step, and updates a TokenMeanLoss there as a user would."""

    def __init__(self, data: list[list[Batch]], iterable: bool, out: Path) -> None:
        super().__init__(data, iterable=iterable)
        self.out = out
        self.train_loss = TokenMeanLoss()
        self.steps: list[dict[str, Any]] = []

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = token_loss(self.net, batch)
        count = count_valid_labels(batch)
        self.train_loss.update(loss, count)
        self.steps.append({
            "batch_idx": batch_idx, "filler": filler_flag(self.trainer), "loss": float(loss.detach()),
            "count": int(count),
        })
        return loss

    def on_train_end(self) -> None:
        value = float(self.train_loss.compute())  # every rank: compute() sums the states over the ranks
        record = {"training_step": self.steps, "metric": value}
        (self.out / f"steps{self.global_rank}.json").write_text(json.dumps(record))


class FillerFlags(Callback):
    """``is_filler_batch`` and ``in_filler_batch()`` in the batch hooks around a micro-batch's forward and backward."""

    HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_train_batch_end")

    def __init__(self, out: Path) -> None:
        self.out = out
        self.flags: dict[str, list[Any]] = {hook: [] for hook in self.HOOKS}

    def _seen(self, hook: str, trainer: pl.Trainer) -> None:
        from token_mean import in_filler_batch

        flag = filler_flag(trainer)
        self.flags[hook].append(flag if flag == in_filler_batch() else "the two disagree")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._seen("on_train_batch_start", trainer)

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._seen("on_before_backward", trainer)

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._seen("on_after_backward", trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._seen("on_train_batch_end", trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.out / f"flags{trainer.global_rank}.json").write_text(json.dumps(self.flags))


def filler_data() -> list[list[Batch]]:
    data = ragged(2, max(FILLER_LENGTHS), seed=91)
    return [rank[:length] for rank, length in zip(data, FILLER_LENGTHS, strict=True)]


@pytest.fixture(scope="module")
def filler_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    """The output folder of one run per (mode, iterable) with uneven ranks, made on first use."""
    runs: dict[tuple[str, bool], Path] = {}

    def run(mode: str, iterable: bool) -> Path:
        if (mode, iterable) not in runs:
            out = tmp_path_factory.mktemp(f"fillers-{mode}-{'iterable' if iterable else 'sized'}")
            monitor = DenominatorMonitor(logging_interval=1)
            logger = CSVLogger(out, name="logs", version=0)
            # check_count=False: training_step records every call, and the count check's replays would add three
            fit(FillerModule(filler_data(), iterable, out), strategy_for(mode, timeout=SHORT_TIMEOUT,
                                                                         **NO_CHECK.get(mode, {})), out,
                accumulate_grad_batches=FILLER_K, callbacks=[FillerFlags(out), monitor], logger=logger)
            runs[mode, iterable] = out
        return runs[mode, iterable]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_filler_flag_in_batch_hooks(filler_run: Callable[[str, bool], Path], mode: str, iterable: bool) -> None:
    """The filler mark covers the micro-batch's forward and backward (``training_step``, ``on_before_backward``,
    ``on_after_backward``), as under Fabric from the yield to ``accumulator.backward``; the hooks around it see no
    filler (``on_train_batch_start`` runs before the strategy knows the window's K, ``on_train_batch_end`` after the
    update, as a validation loop would)."""
    out = filler_run(mode, iterable)
    # a stream's end is only agreed window by window: its last window is padded to K with fillers on every rank
    total = -(-max(FILLER_LENGTHS) // FILLER_K) * FILLER_K if iterable else max(FILLER_LENGTHS)
    for rank, length in enumerate(FILLER_LENGTHS):
        expected = [index >= length for index in range(total)]
        steps = json.loads((out / f"steps{rank}.json").read_text())["training_step"]
        flags = json.loads((out / f"flags{rank}.json").read_text())
        assert [step["filler"] for step in steps] == expected, f"rank {rank}: is_filler_batch in training_step"
        for hook, seen in flags.items():
            inside = hook in ("on_before_backward", "on_after_backward")
            assert seen == (expected if inside else [False] * total), f"rank {rank}: is_filler_batch in {hook}"


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_token_mean_loss_ignores_fillers(filler_run: Callable[[str, bool], Path], mode: str, iterable: bool) -> None:
    """The metric updated in training_step equals the token mean of the losses of the real micro-batches."""
    out = filler_run(mode, iterable)
    records = [json.loads((out / f"steps{rank}.json").read_text()) for rank in range(2)]
    real = [
        step
        for rank, record in enumerate(records)
        for step in record["training_step"]
        if step["batch_idx"] < FILLER_LENGTHS[rank]
    ]
    expected = math.fsum(step["loss"] * step["count"] for step in real) / math.fsum(step["count"] for step in real)
    for rank, record in enumerate(records):
        assert abs(record["metric"] - expected) <= EXACT * abs(expected), f"rank {rank}: {record['metric']} {expected}"


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_monitor_counts_ignore_fillers(filler_run: Callable[[str, bool], Path], mode: str, iterable: bool) -> None:
    """The monitor reads the strategy's window: the counts it logs leave the fillers out, and the run is exact."""
    out = filler_run(mode, iterable)
    data = filler_data()
    rank_counts = [
        [sum(float((rank[i]["labels"] != -100).sum()) for i in window if i < len(rank)) for rank in data]
        for window in windows_of(max(FILLER_LENGTHS), FILLER_K)
    ]
    metrics = logged(out)
    assert sorted(metrics) == list(range(len(rank_counts)))
    for step, counts in enumerate(rank_counts):
        got = metrics[step]
        assert got["global_count"] == sum(counts), f"step {step}"
        assert (got["rank_count_min"], got["rank_count_max"]) == (min(counts), max(counts)), f"step {step}"
        assert got["rank_count_mean"] == pytest.approx(sum(counts) / 2, rel=EXACT), f"step {step}"
    assert_exact(params_of(out), reference_steps(lightning_steps(data, FILLER_K))[0])


# ---------------------------------------------------------------------------------------------------------------
# Lightning's loader checks see the user's DataLoader
# ---------------------------------------------------------------------------------------------------------------


class LoaderIdentity(Callback):
    """Each rank writes whether `trainer.train_dataloader` is a DataLoader and the object `train_dataloader()` made."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: list[dict[str, bool]] = []

    def _look(self, trainer: pl.Trainer, pl_module: Any) -> None:
        loaders, returned = trainer.train_dataloader, pl_module.returned
        if isinstance(returned, dict):
            found = loaders if isinstance(loaders, dict) else {}
            pairs = [(found.get(name), mine) for name, mine in returned.items()]
        else:
            pairs = [(loaders, returned)]
        self.seen.append({
            "is_dataloader": all(isinstance(loader, DataLoader) for loader, _ in pairs),
            "is_the_users": all(loader is mine for loader, mine in pairs),
        })

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._look(trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._look(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.out / f"loaders{trainer.global_rank}.json").write_text(json.dumps(self.seen))


class OneLoader(TokenModule):
    returned: Any = None

    def train_dataloader(self) -> DataLoader[Batch]:
        self.returned = super().train_dataloader()
        return self.returned


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("loaders", ["one", "several"])
def test_train_dataloader_is_the_users_dataloader(tmp_path: Path, mode: str, loaders: str) -> None:
    """Plain DDP passes: it shows what the strategy must keep."""
    if loaders == "one":
        module: TokenModule = OneLoader(ragged(2, 4, seed=101))
        kwargs: dict[str, Any] = {}
    else:
        module = SeveralLoaders(several_loaders_data(), "dict", None)
        kwargs = {} if mode == "plain" else {"count_fn": count_combined}
    fit(module, strategy_for(mode, timeout=SHORT_TIMEOUT, **kwargs), tmp_path, accumulate_grad_batches=2,
        callbacks=[LoaderIdentity(tmp_path)])
    for rank in range(2):
        seen = json.loads((tmp_path / f"loaders{rank}.json").read_text())
        assert seen and all(s["is_dataloader"] for s in seen), f"rank {rank}: not a DataLoader during fit"
        assert all(s["is_the_users"] for s in seen), f"rank {rank}: not the loader train_dataloader() returned"


class CatchWarnings(Callback):
    """Rank 0 writes the warnings raised between `setup` and `on_train_start`, where Lightning checks the loaders
    (`until_end`: and `on_train_end`)."""

    def __init__(self, out: Path, until_end: bool = False) -> None:
        self.out = out
        self.until_end = until_end
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")  # also what pyproject's filterwarnings ignores

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.until_end:
            self._write(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.until_end:
            self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        self._catcher.__exit__(None, None, None)
        if trainer.global_rank == 0:
            (self.out / "warnings.json").write_text(json.dumps([str(w.message) for w in self._caught]))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_lightnings_worker_warning_is_kept(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`num_workers=0` gets Lightning's "does not have many workers" warning, as under plain DDP (which passes).

    Lightning suggests workers only when the machine has cores to spare (`suggested_max_num_workers`): pretend it
    does, so that the warning is due on any machine.
    """
    from lightning.pytorch.trainer.connectors import data_connector

    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda local_world_size: 4)
    fit(TokenModule(ragged(2, 2, seed=111)), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path,
        callbacks=[CatchWarnings(tmp_path)])
    caught = json.loads((tmp_path / "warnings.json").read_text())
    assert any("'train_dataloader' does not have many workers" in message for message in caught), caught


# ---------------------------------------------------------------------------------------------------------------
# diagnoses that name the likely cause
# ---------------------------------------------------------------------------------------------------------------


def count_every_token(batch: Batch) -> Tensor:
    """Disagrees with the model's mask: counts the targets the loss ignores too."""
    return (batch["labels"] >= -100).sum()


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_mask_disagreeing_with_count_fn_blames_count_fn(tmp_path: Path, mode: str) -> None:
    """A micro-batch counted as holding items whose loss is 0/0: the mask disagrees, the model did not diverge."""
    data = ragged(2, 4, seed=121)
    data[1][1] = {**data[1][1], "labels": torch.full_like(data[1][1]["labels"], -100)}
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT, count_fn=count_every_token)
    module = TokenModule(data)
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy, tmp_path, accumulate_grad_batches=2))
    for message in errors:
        assert message.startswith("DenominatorError"), message
        assert "count_fn" in message, message
        assert "learning rate" not in message, message


def with_count(generator: torch.Generator, count: int, rows: int = 4, length: int = 8) -> Batch:
    x = torch.randn(rows, length, FEATURES, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (rows * length,), generator=generator)
    labels[count:] = -100
    return {"x": x, "labels": labels.view(rows, length)}


NUM_ITEMS_COUNT = 23  # rank 1's first micro-batch: 23 valid targets, and its training_step says 24


def one_more_item_on_rank_one(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    import torch.distributed as dist

    count = int((batch["labels"] != -100).sum())
    return {"loss": loss, "num_items": count + 1 if dist.get_rank() == 1 else count}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_num_items_mismatch_without_count_fn(tmp_path: Path) -> None:
    """Lookahead with the default count: the advice must not be to drop a `count_fn` nobody passed.

    Only lookahead: in deferred mode without `count_fn`, 'num_items' is the count and nothing can disagree.
    """
    generator = torch.Generator().manual_seed(131)
    data = [[with_count(generator, c) for c in counts] for counts in ((17, 30, 9, 26), (NUM_ITEMS_COUNT, 12, 28, 5))]
    module = TokenModule(data, output_fn=one_more_item_on_rank_one)
    strategy = strategy_for("lookahead", timeout=SHORT_TIMEOUT)
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy, tmp_path, accumulate_grad_batches=2))
    for message in errors:
        assert message.startswith("DenominatorError"), message
        assert "drop `count_fn`" not in message, message
        # the numbers of the window's disagreeing micro-batches (rank 1's first two: counts 23 and 12, each + 1)
        counted = NUM_ITEMS_COUNT + 12
        for number in (counted, counted + 2):
            assert re.search(rf"\b{number}(\.0+)?\b", message), f"{number} not named: {message}"


# ---------------------------------------------------------------------------------------------------------------
# counts as users write them: a numpy integer, and count_fn by import path in LightningCLI
# ---------------------------------------------------------------------------------------------------------------


def numpy_count(batch: Batch) -> np.int64:
    return np.int64(int((batch["labels"] != -100).sum()))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_numpy_integer_count(tmp_path: Path, mode: str) -> None:
    data = ragged(2, 5, seed=141)
    kwargs = {} if mode == "plain" else {"count_fn": numpy_count}
    params, _ = fit(TokenModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT, **kwargs), tmp_path,
                    accumulate_grad_batches=2)
    expected, _ = reference_steps(lightning_steps(data, 2))
    if mode == "plain":
        assert_misses(params, expected)
    else:
        assert_exact(params, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", ["args", "yaml"])
def test_count_fn_by_import_path_in_lightning_cli(tmp_path: Path, mode: str, source: str) -> None:
    """A plain function without a return annotation, named by its import path."""
    from _cli_module import CLIModule, count_tokens
    from lightning.pytorch.cli import LightningCLI

    common = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
    if source == "args":
        args = [
            "--trainer.strategy=token_mean.TokenMeanDDPStrategy",
            "--trainer.strategy.count_fn=_cli_module.count_tokens",
            f"--trainer.strategy.mode={mode}",
            *common,
        ]
    else:
        config = tmp_path / "config.yaml"
        config.write_text(
            "trainer:\n"
            "  strategy:\n"
            "    class_path: token_mean.TokenMeanDDPStrategy\n"
            "    init_args:\n"
            "      count_fn: _cli_module.count_tokens\n"
            f"      mode: {mode}\n"
        )
        args = [f"--config={config}", *common]
    cli = LightningCLI(CLIModule, run=False, args=args, save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, TokenMeanDDPStrategy)
    assert strategy.count_fn is count_tokens and strategy.mode == mode


# ---------------------------------------------------------------------------------------------------------------
# counts too small or too large for float64: refused before the optimizer step, naming the count
# ---------------------------------------------------------------------------------------------------------------


def weighted_count(batch: Batch) -> float:
    """Float sample weights: the batch's weight per valid target."""
    return float(batch["weight"]) * float((batch["labels"] != -100).sum())


def weighted(data: list[list[Batch]], weight_of: Callable[[int], float]) -> list[list[Batch]]:
    return [
        [{**batch, "weight": torch.tensor(weight_of(index), dtype=torch.float64)} for index, batch in enumerate(rank)]
        for rank in data
    ]


def assert_finite_checkpoints(directory: Path) -> None:
    paths = sorted(directory.glob("*.ckpt"))
    assert paths, "no checkpoint was written before the error"
    for path in paths:
        state = torch.load(path, weights_only=False, map_location="cpu")
        for name, value in state["state_dict"].items():
            assert bool(torch.isfinite(value).all()), f"{path.name}: {name} is not finite"


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_subnormal_window_count(tmp_path: Path, mode: str) -> None:
    """Weights 1e-310 per item in the third window (batches 4 and 5 on both ranks): N is subnormal, P/N overflows."""
    data = weighted(ragged(2, 8, seed=151), lambda index: 1e-310 if index in (4, 5) else 1.0)
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", every_n_train_steps=1, save_top_k=-1, save_last=True
    )
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT, count_fn=weighted_count)
    errors = raises_everywhere(tmp_path, lambda: fit(
        TokenModule(data), strategy, tmp_path, accumulate_grad_batches=2, enable_checkpointing=True,
        callbacks=[checkpoints],
    ))
    assert_finite_checkpoints(tmp_path / "checkpoints")
    assert not list((tmp_path / "checkpoints").glob("*step=3*")), "window 3 made an optimizer step"
    for message in errors:
        assert message.startswith("DenominatorError"), message
        assert "count" in message and re.search(r"1(\.\d+)?e-3\d\d|too small|subnormal|overflow", message), message
        assert "learning rate" not in message, message


def huge_count(batch: Batch) -> float:
    return 1e308


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_window_count_overflows(tmp_path: Path, mode: str) -> None:
    """4 micro-batches of count 1e308 per window: N overflows to inf. Named as a count problem, not a NaN loss."""
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT, count_fn=huge_count)
    errors = raises_everywhere(
        tmp_path, lambda: fit(TokenModule(ragged(2, 4, seed=161)), strategy, tmp_path, accumulate_grad_batches=2)
    )
    for message in errors:
        assert message.startswith("DenominatorError"), message  # not a bare OverflowError
        assert "count" in message and re.search(r"1(\.0+)?e\+308|overflow|too large", message), message
        assert "learning rate" not in message and "loss of a micro-batch" not in message, message


# ---------------------------------------------------------------------------------------------------------------
# a mid-epoch checkpoint written under the strategy resumes under plain DDP
# ---------------------------------------------------------------------------------------------------------------


class StateRecordingLoader(PositionLoader):
    """Writes the state Lightning hands to `load_state_dict`."""

    out: Path
    rank: int

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        (self.out / f"loaded{self.rank}.json").write_text(json.dumps(state_dict))
        super().load_state_dict(state_dict)


class StateRecordingModule(ResumableModule):
    def __init__(self, data: list[list[Batch]], out: Path) -> None:
        super().__init__(data, stateful=True)
        self.out = out

    def train_dataloader(self) -> DataLoader[Batch]:
        loader = StateRecordingLoader(ListDataset(self.data[self.global_rank]))
        loader.out, loader.rank = self.out, self.global_rank
        return loader


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_resumes_under_plain_ddp(tmp_path: Path, mode: str) -> None:
    """7 batches per rank, K = 2: the checkpoint after step 2 is mid-epoch, after 4 batches."""
    data = ragged(2, 7, seed=171)
    fit_checkpointed(ResumableModule(data, True), mode, tmp_path / "strategy", epochs=1)
    out = tmp_path / "plain"
    fit(StateRecordingModule(data, out), strategy_for("plain", timeout=SHORT_TIMEOUT), out, accumulate_grad_batches=2,
        ckpt_path=checkpoint_at(tmp_path / "strategy", 2))
    for rank in range(2):
        loaded = json.loads((out / f"loaded{rank}.json").read_text())
        assert loaded == {"handed_out": 4}, f"rank {rank}: load_state_dict got {loaded}"


# ---------------------------------------------------------------------------------------------------------------
# an IterableDataset whose __len__ overstates what it yields
# ---------------------------------------------------------------------------------------------------------------

STATED, YIELDED = 20, 12


class Overstated(StreamDataset):
    def __len__(self) -> int:
        return STATED


class OverstatedModule(TokenModule):
    def train_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(Overstated(self.data[self.global_rank]), batch_size=None)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("k", [3, 5])
def test_len_overstates_the_stream(tmp_path: Path, mode: str, k: int) -> None:
    """Lightning trusts `len()` = 20 (no prefetch) and ends the epoch when the stream does, after 12 batches. With K
    = 5 the last window [10, 11] never reaches its stepping batch: Lightning makes no step for it (and the next
    epoch's first batch zeroes its gradient), so plain DDP takes 2 steps per epoch; with K = 3, 4. The strategy
    treats an IterableDataset's length as a hint and agrees on the stream's end window by window: no phantom step
    past the stream's end, and the short last window [10, 11] is trained (padded to K with zero-weight fillers)
    instead of dropped."""
    data = ragged(2, YIELDED, seed=181)
    params, _ = fit(OverstatedModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path,
                    accumulate_grad_batches=k, max_epochs=2)
    windows = [window for window in windows_of(YIELDED, k) if mode != "plain" or len(window) == k]
    steps = [[rank[i] for rank in data for i in window] for _ in range(2) for window in windows]
    expected, _ = reference_steps(steps)
    summary = summary_of(tmp_path)
    assert summary["global_step"] == len(steps), "optimizer steps"
    if mode == "plain":
        assert_misses(params, expected)
        return
    assert summary["skipped_steps"] == 0
    assert_exact(params, expected)


# ---------------------------------------------------------------------------------------------------------------
# a mid-epoch resume with another number of processes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_mid_epoch_resume_with_other_process_count(tmp_path: Path, mode: str, saved_on: int, resumed_on: int) -> None:
    data = ragged(2, 7, seed=191)
    saved = tmp_path / "saved"
    if saved_on == 2:
        fit_checkpointed(ResumableModule(data, True), mode, saved, epochs=1)
    else:
        checkpoints = ModelCheckpoint(dirpath=saved / "checkpoints", every_n_train_steps=2, save_top_k=-1)
        fit(ResumableModule(data, True), strategy_for(mode, timeout=SHORT_TIMEOUT), saved, devices=1,
            accumulate_grad_batches=2, enable_checkpointing=True, callbacks=[checkpoints])
    checkpoint = checkpoint_at(saved, 2)  # mid-epoch: 4 of 7 batches
    out = tmp_path / "resumed"
    strategy = strategy_for(mode, timeout=SHORT_TIMEOUT)
    errors = raises_everywhere(out, lambda: fit(
        ResumableModule(data, True), strategy, out, devices=resumed_on, accumulate_grad_batches=2, ckpt_path=checkpoint,
    ), ranks=resumed_on)
    for message in errors:
        assert "processes" in message, message
        assert re.search(rf"\b{saved_on}\b", message) and re.search(rf"\b{resumed_on}\b", message), message
    assert len(set(errors)) == 1, "the ranks raised different errors"


# ---------------------------------------------------------------------------------------------------------------
# DenominatorMonitor under plain DDP applies the strategy's count checks
# ---------------------------------------------------------------------------------------------------------------


def bad_on_rank_one(value: float) -> Callable[[Batch], Any]:
    def count_fn(batch: Batch) -> Any:
        import torch.distributed as dist

        return value if dist.get_rank() == 1 else (batch["labels"] != -100).sum()

    return count_fn


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [float("nan"), -3.0], ids=["nan", "negative"])
def test_monitor_under_plain_ddp_checks_counts(tmp_path: Path, value: float) -> None:
    monitor = DenominatorMonitor(count_fn=bad_on_rank_one(value))
    errors = raises_everywhere(tmp_path, lambda: fit(
        TokenModule(ragged(2, 4, seed=201)), strategy_for("plain", timeout=SHORT_TIMEOUT), tmp_path,
        accumulate_grad_batches=2, callbacks=[monitor],
    ))
    for message in errors:
        assert message.startswith("DenominatorError"), message


# ---------------------------------------------------------------------------------------------------------------
# K changed by a callback (`trainer.accumulate_grad_batches = ...`, a batch-size ramp)
#
# Lightning steps when `ready % K == 0` with the K in force, zeroes the gradient at batches whose index is a multiple
# of it, and divides each micro-batch's loss by it. A change where a window starts, at a multiple of the new K, is a
# clean ramp, exact in both modes; a change inside a window (Lightning steps a window that mixes two divisors, or
# zeroes the gradient in its middle) is refused on every rank in both modes, naming the change: the window's first
# backward passes were normalized for the window as planned.
# ---------------------------------------------------------------------------------------------------------------


class SetsK(Callback):
    """Sets `trainer.accumulate_grad_batches` to `after` at batch `at` of epoch 0 (before that batch is trained)."""

    def __init__(self, at: int, after: int) -> None:
        self.at = at
        self.after = after

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == self.at:
            trainer.accumulate_grad_batches = self.after


K_RAMPS = [  # (K before, batch of the change, K after, batches, Lightning's windows, modes that follow it exactly)
    ("at-a-window-start", (2, 4, 4, 12, [[0, 1], [2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], MODES)),
    ("inside-a-window", (2, 1, 4, 8, [[0, 1, 2, 3], [4, 5, 6, 7]], ())),
    ("inside-where-lightning-zeroes", (3, 2, 2, 8, None, ())),  # plain DDP drops batches 0, 1: no exact control
]


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "before", "at", "after", "batches", "windows", "exact_in"), [
    pytest.param(mode, *case, id=f"{name}-{mode}") for name, case in K_RAMPS
    for mode in (*MODES, *(("plain",) if case[4] is not None else ()))
])
def test_k_changed_by_a_callback(tmp_path: Path, mode: str, before: int, at: int, after: int, batches: int,
                                 windows: list[list[int]] | None, exact_in: tuple[str, ...]) -> None:
    data = ragged(2, batches, seed=211)
    module, strategy = TokenModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT)
    kwargs: dict[str, Any] = {"accumulate_grad_batches": before, "callbacks": [SetsK(at, after)]}
    if mode != "plain" and mode not in exact_in:
        errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(module, strategy, tmp_path, **kwargs))
        for message in errors:
            assert f"`trainer.accumulate_grad_batches` changed from {before} to {after} at batch {at}" in message
        assert len(set(errors)) == 1, errors
        return
    assert windows is not None
    params, _ = fit(module, strategy, tmp_path, **kwargs)
    expected, _ = reference_steps([[rank[i] for rank in data for i in window] for window in windows])
    assert summary_of(tmp_path)["global_step"] == len(windows), "optimizer steps"
    if mode == "plain":
        assert_misses(params, expected)
    else:
        assert_exact(params, expected)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_k_changed_at_a_window_start_of_a_stream(tmp_path: Path, mode: str) -> None:
    """The same ramp on a stream: the last window's record agreed that the stream goes on by one window, which is
    a window of the new K; Lightning's fetcher follows that end (without, lookahead raised and deferred stepped by
    the old K's windows: 5 steps, not 4)."""
    before, at, after, batches, windows, _ = dict(K_RAMPS)["at-a-window-start"]
    data = ragged(2, batches, seed=211)
    module, strategy = TokenModule(data, iterable=True), strategy_for(mode, timeout=SHORT_TIMEOUT)
    params, _ = fit(module, strategy, tmp_path, accumulate_grad_batches=before, callbacks=[SetsK(at, after)])
    expected, _ = reference_steps([[rank[i] for rank in data for i in window] for window in windows])
    assert summary_of(tmp_path)["global_step"] == len(windows), "optimizer steps"
    (assert_misses if mode == "plain" else assert_exact)(params, expected)


# ---------------------------------------------------------------------------------------------------------------
# a loader whose __len__ understates what it yields (a token-budget sampler with an estimated length)
#
# Lightning sizes the epoch by `len()` and stops there: plain DDP silently trains 10 of the 12 batches each rank's
# loader yields. The strategy reads one batch past the epoch's end at its last window (a loader known to yield fresh
# memory only) and every rank raises before that window's update.
# ---------------------------------------------------------------------------------------------------------------

ESTIMATED, HOLDS = 10, 12


class EstimatedLength(torch.utils.data.Sampler[int]):
    """Yields every index of its dataset; its `__len__` is an estimate, two short."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        yield from range(self.size)

    def __len__(self) -> int:
        return self.size - (HOLDS - ESTIMATED)


class EstimatedLengthModule(TokenModule):
    def train_dataloader(self) -> DataLoader[Batch]:
        dataset = ListDataset(self.data[self.global_rank])
        return DataLoader(dataset, batch_size=None, sampler=EstimatedLength(len(dataset)))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_len_understates_the_loader(tmp_path: Path, mode: str) -> None:
    data = ragged(2, HOLDS, seed=221)
    module, strategy = EstimatedLengthModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT)
    if mode == "plain":  # the control: it trains the first 10 batches only, and misses the run over all 12
        params, _ = fit(module, strategy, tmp_path, accumulate_grad_batches=3)
        expected, _ = reference_steps(lightning_steps(data, 3))
        assert summary_of(tmp_path)["global_step"] == 4
        assert_misses(params, expected)
        return
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(module, strategy, tmp_path,
                                                                  accumulate_grad_batches=3))
    assert len(set(errors)) == 1, errors
    assert "ranks 0, 1: the training loader yielded more batches than its `len()`" in errors[0], errors[0]
    assert "optimizer step 3 (epoch 0, batches 9..9)" in errors[0], errors[0]


class RefilledEstimated(Dataset[Batch]):
    """A map-style dataset that returns one buffer, refilled in place for every index (a pinned staging buffer)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self.buffer = {key: torch.empty_like(value) for key, value in batches[0].items()}

    def __getitem__(self, index: int) -> Batch:
        for key, value in self.batches[index].items():
            self.buffer[key].copy_(value)
        return self.buffer

    def __len__(self) -> int:
        return len(self.batches)


class RefilledEstimatedModule(TokenModule):
    """Each rank's batches from one refilled buffer, through the sampler whose `len()` is two short."""

    def train_dataloader(self) -> DataLoader[Batch]:
        dataset = RefilledEstimated(self.data[self.global_rank])
        return DataLoader(dataset, batch_size=None, sampler=EstimatedLength(len(dataset)))


def refilled_estimated_data(seed: int) -> list[list[Batch]]:
    """12 same-shape batches per rank (one buffer holds each of them in turn)."""
    generator = torch.Generator().manual_seed(seed)
    return [[nonempty(make_batch(generator, 2, 4, 0.3 + 0.05 * (index % 7))) for index in range(HOLDS)]
            for _ in range(2)]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["deferred", "plain"])
def test_len_understates_a_loader_that_refills_one_buffer(tmp_path: Path, mode: str) -> None:
    """Reading past the epoch's end before the last backward would overwrite the batch in flight, so the ranks say
    they are unsure in the last window's record and check after the backward, in one more collective: every rank
    still raises before that window's update (lookahead refuses such a loader at once: test_buffer_refilled_in_place).
    Control: plain DDP silently trains the 10 batches of `len()`."""
    data = refilled_estimated_data(seed=223)
    module, strategy = RefilledEstimatedModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT)
    if mode == "plain":
        params, _ = fit(module, strategy, tmp_path, accumulate_grad_batches=3)
        assert summary_of(tmp_path)["global_step"] == 4
        assert_misses(params, reference_steps(lightning_steps(data, 3))[0])
        return
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(module, strategy, tmp_path,
                                                                  accumulate_grad_batches=3))
    assert len(set(errors)) == 1, errors
    assert "ranks 0, 1: the training loader yielded more batches than its `len()`" in errors[0], errors[0]
    assert "optimizer step 3 (epoch 0, batches 9..9)" in errors[0], errors[0]


@pytest.mark.distributed
def test_a_refilled_buffer_whose_len_is_exact_is_trained_exactly(tmp_path: Path) -> None:
    """The check after the backward is no false alarm: the same refilled buffer through an exact sampler trains all
    12 batches in deferred mode, exactly."""
    data = refilled_estimated_data(seed=224)

    class Exact(RefilledEstimatedModule):
        def train_dataloader(self) -> DataLoader[Batch]:
            return DataLoader(RefilledEstimated(self.data[self.global_rank]), batch_size=None)

    params, _ = fit(Exact(data), strategy_for("deferred", timeout=SHORT_TIMEOUT), tmp_path, accumulate_grad_batches=3)
    assert_exact(params, reference_steps(lightning_steps(data, 3))[0])


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_len_understates_a_loader_restarted_by_a_mid_epoch_resume(tmp_path: Path, mode: str) -> None:
    """Resumed at batch 4 from a loader without a state, Lightning restarts it from its first batch and trains 6 of
    its items (plain Lightning too): the loader then still holds 6 by design, and only a 13th item says its `len()`
    is short. The resumed epoch's last window reads the loader past its whole length after the backward: every rank
    raises before that update (this check used to be skipped after such a resume). Control: the same resume of a
    loader whose `len()` is exact trains to the epoch's end (the 6 items it still holds are no alarm)."""

    class Restarted(ResumableModule):
        def train_dataloader(self) -> DataLoader[Batch]:
            dataset = ListDataset(self.data[self.global_rank])
            sampler = EstimatedLength(len(dataset)) if self.estimated else None
            return DataLoader(dataset, batch_size=None, sampler=sampler)

        estimated = True

    data = ragged(2, HOLDS, seed=226)
    fit_checkpointed(Restarted(data, stateful=False), mode, tmp_path / "first", epochs=1, max_steps=2, every=2)
    checkpoint = checkpoint_at(tmp_path / "first", 2)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit_checkpointed(
        Restarted(data, stateful=False), mode, tmp_path / "resumed", ckpt_path=checkpoint, epochs=1))
    assert len(set(errors)) == 1, errors
    assert "ranks 0, 1: the training loader yielded more batches than its `len()`" in errors[0], errors[0]

    Restarted.estimated = False  # a `len()` of 12 for the 12 items
    fit_checkpointed(Restarted(data, stateful=False), mode, tmp_path / "exact", epochs=1, max_steps=2, every=2)
    fit_checkpointed(Restarted(data, stateful=False), mode, tmp_path / "exact-resumed", epochs=1,
                     ckpt_path=checkpoint_at(tmp_path / "exact", 2))
    assert summary_of(tmp_path / "exact-resumed")["global_step"] == HOLDS // 2


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_len_understates_the_loader_under_a_limit_that_does_not_cut_it(tmp_path: Path, mode: str) -> None:
    """`limit_train_batches=20` over a loader whose `len()` says 10 (it yields 12): Lightning's epoch is
    min(10, 20) = 10 batches, the limit ends nothing, and the understated length is the same silent loss as
    without a limit: every rank raises. (A limit below `len()` ends the epoch before the loader by design.)"""
    data = ragged(2, HOLDS, seed=225)
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        EstimatedLengthModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path, accumulate_grad_batches=3,
        limit_train_batches=20))
    assert len(set(errors)) == 1, errors
    assert "ranks 0, 1: the training loader yielded more batches than its `len()`" in errors[0], errors[0]


# ---------------------------------------------------------------------------------------------------------------
# `limit_train_batches` as a fraction with uneven ranks: Lightning limits each rank to int(frac * its own length)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_limit_train_batches_fraction_with_uneven_ranks(tmp_path: Path, mode: str) -> None:
    """Ranks of 8 and 4 batches, `limit_train_batches=0.5`: rank 0 trains 4, rank 1 its first 2 and then repeats a
    filler. (Plain DDP cannot run it: its ranks would step different numbers of times.)"""
    data = ragged(2, 8, seed=231)
    data[1] = data[1][:4]
    params, windows = fit(TokenModule(data), strategy_for(mode, timeout=SHORT_TIMEOUT), tmp_path,
                          accumulate_grad_batches=2, limit_train_batches=0.5)
    expected, counts = reference_steps(lightning_steps([data[0][:4], data[1][:2]], 2))
    assert [window["global_count"] for window in windows] == counts
    assert_exact(params, expected)
    # the control: training rank 1's batches 2 and 3 as well (what the limit excludes) is measurably another run
    unlimited, _ = reference_steps(lightning_steps([data[0][:4], data[1][:4]], 2))
    assert_misses(unlimited, expected)


# ---------------------------------------------------------------------------------------------------------------
# StochasticWeightAveraging with a BatchNorm model
#
# Lightning adds an epoch that copies the average into the model, resets the BatchNorm statistics and runs forward
# passes only (`fit_loop._skip_backward`), with K = the epoch's length + 1: no backward, but the optimizer still steps
# at the epoch's last batch, re-applying the gradient the last window left. The strategy runs that epoch as plain DDP
# does. On micro-batches of equal counts plain DDP's mean of means is the token mean, so plain DDP is the reference.
# ---------------------------------------------------------------------------------------------------------------


class NormedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.hidden = torch.nn.Linear(FEATURES, 6, dtype=torch.float64)
        self.norm = torch.nn.BatchNorm1d(6, dtype=torch.float64)
        self.out = torch.nn.Linear(6, CLASSES, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.hidden(x)
        return self.out(torch.tanh(self.norm(hidden.flatten(0, 1)).view_as(hidden)))


class NormedModule(TokenModule):
    def __init__(self, data: list[list[Batch]]) -> None:
        super().__init__(data)
        self.net = NormedNet()


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_swa_with_batch_norm_runs_its_batch_norm_epoch_as_plain_ddp(tmp_path: Path, mode: str) -> None:
    from _harness import sft_batches
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    data = sft_batches("uniform", 2, 4, seed=241)
    runs = {}
    for method in ("plain", mode):
        swa = StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1)
        runs[method], _ = fit(NormedModule(data), strategy_for(method, timeout=SHORT_TIMEOUT), tmp_path / method,
                              accumulate_grad_batches=2, max_epochs=2, callbacks=[swa])
    assert summary_of(tmp_path / mode)["global_step"] == summary_of(tmp_path / "plain")["global_step"] == 5
    assert set(runs[mode]) == set(runs["plain"]) and "norm.running_mean" in runs["plain"]
    assert runs[mode]["norm.num_batches_tracked"] == runs["plain"]["norm.num_batches_tracked"]
    floats = {name: value for name, value in runs["plain"].items() if value.is_floating_point()}
    assert_exact(runs[mode], floats)


# ---------------------------------------------------------------------------------------------------------------
# GradientAccumulationScheduler and a mid-epoch resume
#
# Lightning skips `on_train_epoch_start` on a mid-epoch restart, so the scheduler does not set the resumed epoch's K:
# the rest of it runs with K = 1 (plain Lightning too). The strategy knows the K it saved and warns on rank 0.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheduled", [True, False], ids=["scheduler", "constant-k"])
def test_mid_epoch_resume_with_a_k_schedule_warns(tmp_path: Path, mode: str, scheduled: bool) -> None:
    """K = 2 in epoch 0 and 3 in epoch 1 (6 batches each); resumed after step 4 (batch 2 of epoch 1). The control: K
    = 2 throughout, resumed at the same step, warns nothing and matches the uninterrupted run."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    data = ragged(2, 6, seed=251)
    runs = {}
    for run in ("full", "resumed"):
        kwargs: dict[str, Any] = {"accumulate": 1, "callbacks": [GradientAccumulationScheduler({0: 2, 1: 3})]}
        if not scheduled:
            kwargs = {"accumulate": 2, "callbacks": []}
        kwargs["callbacks"].append(CatchWarnings(tmp_path / run, until_end=True))
        ckpt_path = checkpoint_at(tmp_path / "full", 4) if run == "resumed" else None
        runs[run] = fit_checkpointed(ResumableModule(data, True), mode, tmp_path / run, ckpt_path=ckpt_path, **kwargs)
    caught = [w for w in json.loads((tmp_path / "resumed" / "warnings.json").read_text()) if "token_mean" in w]
    if not scheduled:
        # Lightning's ModelCheckpoint(every_n_train_steps=2) saves again after the resumed run's first batch (its
        # step counter has not moved), inside window [2, 3]: the strategy says so, and nothing else
        assert [w.split(", after")[0] for w in caught] == [
            "token_mean: saving a checkpoint inside the accumulation window of optimizer step 4 (epoch 1, batches"
            " 2..3)"], caught
        assert_exact(runs["resumed"], runs["full"])
        return
    (message,) = caught
    assert "`accumulate_grad_batches` = 1, but the checkpoint was written with 3" in message, message
    assert "skips `on_train_epoch_start` on a mid-epoch restart" in message, message
    assert_misses(runs["resumed"], runs["full"])  # what the warning is about


def _estimated_length_loop(fabric: Any, data: list[list[Batch]], mode: str) -> int:
    """The accumulator's loop over a Fabric loader whose sampler's `__len__` is two short; the batches it trained."""
    from _fabric import setup, shifted_loss

    from token_mean import count_shifted_labels
    from token_mean.fabric import TokenMeanAccumulator

    model, optimizer = setup(fabric)
    dataset = ListDataset(data[fabric.global_rank])
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=None, sampler=EstimatedLength(len(dataset))),
                                      use_distributed_sampler=False)
    if mode == "plain":  # a plain loop iterates the loader itself
        return sum(1 for _ in loader)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=3, mode=mode, count_fn=count_shifted_labels)
    trained = 0
    for batch in accumulator.batches(loader):
        with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
            accumulator.backward(shifted_loss(model, batch))
        trained += 1
        if not accumulator.accumulating:
            accumulator.finish()
            optimizer.step()
            optimizer.zero_grad()
    return trained


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_len_understates_the_loader_under_fabric(tmp_path: Path, mode: str) -> None:
    """The same loader under Fabric: a plain loop iterates all 12 batches (Python does not trust `len()`); the
    accumulator, whose pass is sized by `len()`, raises on every rank at the pass's last window instead of silently
    training 10."""
    from _fabric import fabric_for, launched
    from _fabric_loop import every_rank_raises

    data = ragged(2, HOLDS, seed=222)
    if mode == "plain":
        assert launched(fabric_for("ddp"), _estimated_length_loop, data, mode) == HOLDS
        return
    errors = every_rank_raises(fabric_for("ddp"), tmp_path, _estimated_length_loop, data, mode)
    assert len(set(errors)) == 1, errors
    assert "ranks 0, 1: the training loader yielded more batches than its `len()`" in errors[0], errors[0]
