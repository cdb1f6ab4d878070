"""Participation and bad input: exhausted ranks, exact sharding, and errors that every rank raises together.

Each bad-input test has its own timeout: a rank left waiting in a collective would show up as a failure, not a
frozen suite.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import (
    EXACT,
    FORK,
    MODES,
    SHORT_TIMEOUT,
    Batch,
    TokenModule,
    constant,
    fit,
    make_batch,
    ragged_batches,
    reference,
    relative_error,
    token_loss,
)
from _ranks import raises_everywhere
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from token_mean import ExactDistributedSampler, TokenMeanDDPStrategy

# ---------------------------------------------------------------------------------------------------------------
# exhausted ranks
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_uneven_ranks_match_reference_on_real_items(tmp_path: Path, mode: str, iterable: bool) -> None:
    """Rank 1 runs out after 4 of rank 0's 7 batches; it joins the remaining windows at weight zero."""
    data = ragged_batches(2, 7, seed=21)
    data[1] = data[1][:4]
    strategy = TokenMeanDDPStrategy(mode=mode, **FORK)  # type: ignore[arg-type]
    module = TokenModule(data, iterable=iterable)
    params, windows = fit(module, strategy, tmp_path, accumulate_grad_batches=3, max_epochs=2)
    expected, counts = reference(data, constant(3), epochs=2)
    assert relative_error(params, expected) < EXACT
    assert [w["global_count"] for w in windows] == counts
    assert windows[2]["rank_counts"][1] == 0.0  # the third window (batch 6) is all filler on rank 1


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_uneven_ranks_error_when_padding_is_off(tmp_path: Path) -> None:
    data = ragged_batches(2, 5, seed=22)
    data[1] = data[1][:3]
    strategy = TokenMeanDDPStrategy(pad_uneven_ranks=False, **FORK)
    errors = raises_everywhere(tmp_path, lambda: fit(TokenModule(data), strategy, tmp_path, accumulate_grad_batches=2))
    for rank, message in enumerate(errors):
        assert re.search(r"between 3 and 5 batches[\s\S]*set `pad_uneven_ranks=True`", message), message
        assert f"(this rank: {len(data[rank])})" in message, message


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_streams_ending_in_different_windows_are_an_error_when_padding_is_off(tmp_path: Path, mode: str) -> None:
    """Streams: no length to agree on at fit start. Rank 1's stream ends after window [2, 3], rank 0's goes on: every
    rank raises at that window's end, before its update (the window itself was whole on both ranks)."""
    data = ragged_batches(2, 6, seed=24)
    data[1] = data[1][:4]
    strategy = TokenMeanDDPStrategy(mode=mode, pad_uneven_ranks=False, **FORK)  # type: ignore[arg-type]
    module = TokenModule(data, iterable=True)
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy, tmp_path, accumulate_grad_batches=2))
    assert errors[0] == errors[1], errors
    for message in errors:
        assert message.startswith(f"DenominatorError: token_mean: {_UNEVEN}"), message
        assert "optimizer step 1 (epoch 0, batches 2..3)" in message, message
        assert "keep `pad_uneven_ranks=True`" in message, message


_UNEVEN = "the ranks ran accumulation windows of different lengths: the ranks' streams ended in different windows"


class HalfStreams(TokenModule):
    """Rank 0's loader has a length, rank 1's is a stream (an IterableDataset on some ranks only)."""

    def train_dataloader(self) -> DataLoader[Batch]:
        self.iterable = self.global_rank == 1
        return super().train_dataloader()


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_a_length_on_some_ranks_only_is_an_error_everywhere(tmp_path: Path, mode: str) -> None:
    """Lightning sizes a loader in a collective that only the ranks with a sized one join (a hang, under plain DDP
    too): the strategy refuses it on every rank first."""
    data = ragged_batches(2, 4, seed=25)
    strategy = TokenMeanDDPStrategy(mode=mode, timeout=SHORT_TIMEOUT, **FORK)  # type: ignore[arg-type]
    errors = raises_everywhere(tmp_path, lambda: fit(HalfStreams(data), strategy, tmp_path, accumulate_grad_batches=2))
    for message in errors:
        assert message.startswith("ValueError: token_mean: the training loaders have a length on some ranks and none"
                                  " on others"), message
        assert "give every rank the same kind of loader" in message, message


# ---------------------------------------------------------------------------------------------------------------
# exact sharding
# ---------------------------------------------------------------------------------------------------------------


def items(count: int, seed: int = 23) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    batches = [make_batch(generator, 1, 4, keep=0.95 - 0.08 * i) for i in range(count)]
    return [{key: value[0] for key, value in batch.items()} for batch in batches]


class ShardedModule(TokenModule):
    def __init__(self, dataset: list[Batch], exact: bool) -> None:
        super().__init__([[]])
        self.dataset = dataset
        self.exact = exact

    def train_dataloader(self) -> DataLoader[Batch]:
        sampler_cls = ExactDistributedSampler if self.exact else DistributedSampler
        sampler = sampler_cls(self.dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(self.dataset, batch_size=2, sampler=sampler)  # type: ignore[arg-type]


def shard(dataset: list[Batch], rank: int, padded: bool) -> list[Batch]:
    """The micro-batches rank `rank` sees: every P-th item, in batches of two."""
    order = list(range(len(dataset)))
    if padded:  # DistributedSampler's way of evening out: repeat items from the start
        order += order[: (-len(order)) % 2]
    mine = [dataset[i] for i in order[rank::2]]
    return [
        {key: torch.stack([item[key] for item in mine[start : start + 2]]) for key in mine[0]}
        for start in range(0, len(mine), 2)
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_exact_sampler_keeps_the_objective(tmp_path: Path, mode: str) -> None:
    dataset = items(9)
    unique = [shard(dataset, rank, padded=False) for rank in range(2)]  # 3 and 2 batches
    expected, _ = reference(unique, constant(2))
    strategy = TokenMeanDDPStrategy(mode=mode, **FORK)  # type: ignore[arg-type]
    params, _ = fit(ShardedModule(dataset, exact=True), strategy, tmp_path / "exact", accumulate_grad_batches=2)
    assert relative_error(params, expected) < EXACT
    # DistributedSampler repeats item 0 on rank 1: the same strategy then optimizes another objective
    strategy = TokenMeanDDPStrategy(mode=mode, **FORK)  # type: ignore[arg-type]
    padded, _ = fit(ShardedModule(dataset, exact=False), strategy, tmp_path / "padded", accumulate_grad_batches=2)
    assert relative_error(padded, expected) > 1e-6
    repeated, _ = reference([shard(dataset, rank, padded=True) for rank in range(2)], constant(2))
    assert relative_error(padded, repeated) < EXACT


def test_exact_sampler_splits_without_repeating() -> None:
    shards = [list(ExactDistributedSampler(range(10), num_replicas=3, rank=r, seed=5)) for r in range(3)]
    assert sorted(index for shard_ in shards for index in shard_) == list(range(10))
    assert [len(ExactDistributedSampler(range(10), num_replicas=3, rank=r)) for r in range(3)] == [4, 3, 3]
    sampler = ExactDistributedSampler(range(10), num_replicas=2, rank=0, seed=5)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    with pytest.raises(ValueError, match=r"`rank` must be in \[0, 2\)"):
        ExactDistributedSampler(range(4), num_replicas=2, rank=2)


# ---------------------------------------------------------------------------------------------------------------
# bad input on one rank: every rank raises the same error, none hangs
# ---------------------------------------------------------------------------------------------------------------


def on_rank_one(value: Any, otherwise: Any) -> Any:
    import torch.distributed as dist

    return value if dist.get_rank() == 1 else otherwise


BAD_COUNTS = [
    ("negative", lambda b: on_rank_one(-3, (b["labels"] != -100).sum()), "rank 1: `count_fn` returned a negative"),
    ("nan", lambda b: on_rank_one(float("nan"), (b["labels"] != -100).sum()), "rank 1: `count_fn` returned a NaN"),
    ("inf", lambda b: on_rank_one(torch.tensor(float("inf")), 3), "rank 1: `count_fn` returned a NaN or infinite"),
    ("type", lambda b: on_rank_one("12", (b["labels"] != -100).sum()), "rank 1: `count_fn` failed"),
    ("shape", lambda b: on_rank_one(b["labels"] != -100, (b["labels"] != -100).sum()), "rank 1: `count_fn` failed"),
]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "count_fn", "match"), BAD_COUNTS, ids=[case[0] for case in BAD_COUNTS])
def test_bad_count_raises_on_every_rank(tmp_path: Path, mode: str, name: str, count_fn: Any, match: str) -> None:
    strategy = TokenMeanDDPStrategy(mode=mode, count_fn=count_fn, **FORK)  # type: ignore[arg-type]
    first, second = raises_everywhere(
        tmp_path, lambda: fit(TokenModule(ragged_batches(2, 4)), strategy, tmp_path, accumulate_grad_batches=2)
    )
    assert first == second, "the ranks raised different errors"
    assert first.startswith("DenominatorError: "), first
    assert match in first and "optimizer step 0 " in first and "Fix:" in first


def no_loss_on_rank_one(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    return on_rank_one({"logits": loss.detach()}, loss)


def nan_loss_on_rank_one(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    return on_rank_one(loss * float("nan"), loss)


def none_on_rank_one(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    return on_rank_one(None, loss)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("output_fn", "match"),
    [
        (no_loss_on_rank_one, "rank 1: `training_step` returned no loss"),
        (none_on_rank_one, "rank 1: `training_step` returned no loss"),
        (nan_loss_on_rank_one, "rank 1: the loss of a micro-batch that the count says holds valid items is NaN"),
    ],
)
def test_bad_loss_raises_on_every_rank(tmp_path: Path, mode: str, output_fn: Any, match: str) -> None:
    strategy = TokenMeanDDPStrategy(mode=mode, **FORK)  # type: ignore[arg-type]
    module = TokenModule(ragged_batches(2, 4), output_fn=output_fn)
    first, second = raises_everywhere(tmp_path, lambda: fit(module, strategy, tmp_path, accumulate_grad_batches=2))
    assert first == second, "the ranks raised different errors"
    assert first.startswith("DenominatorError: "), first
    assert match in first


# ---------------------------------------------------------------------------------------------------------------
# counts decided inside the model
# ---------------------------------------------------------------------------------------------------------------


def drop_even_classes(batch: Batch) -> Batch:
    """The model's own masking rule: targets of even class are not part of the objective."""
    labels = batch["labels"]
    return {"x": batch["x"], "labels": labels.masked_fill((labels % 2 == 0) & (labels != -100), -100)}


def masks_in_forward(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    masked = drop_even_classes(batch)
    num_items = (masked["labels"] != -100).sum()
    return {"loss": token_loss(module.net, masked), "num_items": num_items}


@pytest.mark.distributed
def test_deferred_counts_from_num_items(tmp_path: Path) -> None:
    data = ragged_batches(2, 7, seed=24)
    strategy = TokenMeanDDPStrategy(mode="deferred", **FORK)
    params, windows = fit(TokenModule(data, output_fn=masks_in_forward), strategy, tmp_path, accumulate_grad_batches=3)
    expected, counts = reference(data, constant(3), mask=drop_even_classes)
    assert relative_error(params, expected) < EXACT
    assert [w["global_count"] for w in windows] == counts


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "count_fn"), [("deferred", lambda b: (b["labels"] != -100).sum()), ("lookahead", None)]
)
def test_count_fn_and_num_items_must_agree(tmp_path: Path, mode: str, count_fn: Any) -> None:
    """Two definitions of the denominator that disagree are exactly the bug this package exists to catch."""
    strategy = TokenMeanDDPStrategy(mode=mode, count_fn=count_fn, **FORK)  # type: ignore[arg-type]
    module = TokenModule(ragged_batches(2, 4, seed=25), output_fn=masks_in_forward)
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy, tmp_path))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: ") and "disagree" in errors[0], errors[0]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("iterable", [False, True], ids=["sized", "iterable"])
def test_rank_without_any_batch_is_an_error_everywhere(tmp_path: Path, iterable: bool) -> None:
    """A sized loader of length 0 on rank 1 alone: Lightning raises on that rank only (rank 0 would wait in the next
    collective until the process group's timeout), so the strategy refuses it on every rank first."""
    data = ragged_batches(2, 3, seed=26)
    data[1] = []
    strategy = TokenMeanDDPStrategy(timeout=SHORT_TIMEOUT, **FORK)
    module = TokenModule(data, iterable=iterable)
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy, tmp_path, accumulate_grad_batches=2))
    if iterable:
        assert len(set(errors)) == 1, errors
        assert "yielded no batch this epoch" in errors[0], errors[0]
        return
    for rank, message in enumerate(errors):
        assert message == (
            "ValueError: token_mean: the training loaders of 1 of the 2 ranks have no batch (this rank's:"
            f" {3 - 3 * rank}). A rank without any batch cannot take part in the backward: give every rank at least"
            " one batch."
        ), message
