"""The wrapped training loader: what Lightning inspects must look like the user's loader."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import DataLoader, DistributedSampler

from token_mean._loader import ZERO, TrainIterator, wrap_loader


def count(batch: Any) -> tuple[float, None, str]:
    return float(batch.sum()), None, ""


class StatefulLoader(DataLoader[Any]):
    def state_dict(self) -> dict[str, int]:
        return {"position": 3}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


def test_hands_through_length_sampler_and_state() -> None:
    dataset = torch.arange(10).view(5, 2)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)  # type: ignore[arg-type]
    loader = DataLoader(dataset, batch_size=1, sampler=sampler)
    wrapped = wrap_loader(loader, count, lambda it: None, length=None)
    assert len(wrapped) == len(loader) == 3
    assert wrapped.sampler is sampler and wrapped.dataset is dataset  # Lightning calls sampler.set_epoch
    assert not isinstance(wrapped, _Stateful)  # Lightning would otherwise think it can resume mid-epoch

    stateful = wrap_loader(StatefulLoader(dataset, batch_size=1), count, lambda it: None, length=None)
    assert isinstance(stateful, _Stateful)
    # one entry per rank: Lightning would otherwise restore rank 0's position on every rank
    assert stateful.state_dict() == {"token_mean_ranks": [{"loader": {"position": 3}, "exhausted": False}]}
    stateful.load_state_dict({"token_mean_ranks": [{"loader": {"position": 1}, "exhausted": False}]})
    assert stateful.loader.loaded == {"position": 1}
    stateful.load_state_dict({"position": 2})  # a checkpoint written without the strategy
    assert stateful.loader.loaded == {"position": 2}


def test_unsized_loader_has_no_length() -> None:
    class Stream(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Any:
            yield from range(3)

    wrapped = wrap_loader(DataLoader(Stream(), batch_size=None), count, lambda it: None, length=None)
    assert sized_len(wrapped) is None
    with pytest.raises(TypeError):
        len(wrapped)


def test_reads_ahead_only_when_asked_and_counts_each_batch_once() -> None:
    batches = [torch.tensor([i, 1]) for i in range(5)]
    iterator = TrainIterator(iter(batches), count, length=None)
    assert next(iterator) is batches[0]
    entries = iterator.peek(3)  # the current batch and two ahead
    assert [e.count[0] for e in entries] == [1.0, 2.0, 3.0]
    assert iterator.held == 2
    assert next(iterator) is batches[1] and next(iterator) is batches[2]
    assert [iterator.pop().count[0] for _ in range(3)] == [1.0, 2.0, 3.0]  # type: ignore[union-attr]
    assert iterator.peek(10)[-1].count[0] == 5.0 and len(iterator.peek(10)) == 2  # fewer at the end


def test_pads_a_short_rank_with_zero_weight_repeats() -> None:
    batches = [torch.tensor([1, 1]), torch.tensor([2, 2])]
    iterator = TrainIterator(iter(batches), count, length=4)
    yielded = list(iterator)
    assert len(yielded) == 4 and yielded[2] is batches[1] and yielded[3] is batches[1]
    entries = [iterator.pop() for _ in range(4)]
    assert [e.filler for e in entries] == [False, False, True, True]  # type: ignore[union-attr]
    assert entries[2].count == ZERO  # type: ignore[union-attr]


def test_unsized_ranks_agree_when_to_stop() -> None:
    """A stream that ends first keeps yielding fillers while another rank still has data."""
    others_have_data = iter([True, True, True, False])
    iterator = TrainIterator(
        iter([torch.tensor([1])]), count, length=None, agree=lambda mine, unfillable: (next(others_have_data), False)
    )
    assert len(list(iterator)) == 3
