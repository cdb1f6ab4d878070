"""The reader over fake loaders: positions, fillers, read-ahead, aliasing and resume, with no process and no model.

A fake loader is a callable returning ``(batch,)`` items, raising ``StopIteration`` at its end, as the reader's
``raw_next`` does under Fabric.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from token_mean._reader import UNKNOWN_END, Entry, Reader


def labels_batch(*labels: int) -> dict[str, torch.Tensor]:
    return {"labels": torch.tensor(labels)}


class FakeLoader:
    """Yields ``(batch,)`` for each of ``batches`` (fresh tensors each), counting its reads; a state is its reads."""

    def __init__(self, batches: list[Any]) -> None:
        self.items = [(batch,) for batch in batches]
        self.reads = 0

    def __call__(self) -> Any:
        if self.reads >= len(self.items):
            raise StopIteration
        self.reads += 1
        return self.items[self.reads - 1]

    def state(self) -> dict[str, int]:
        return {"read": self.reads}

    def restart(self) -> None:
        self.reads = 0


class RefillingLoader:
    """Refills one labels buffer in place for every batch (what a loader with a reused pinned buffer does)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.buffer = torch.zeros(3, dtype=torch.long)
        self.reads = 0

    def __call__(self) -> Any:
        if self.reads >= self.length:
            raise StopIteration
        self.buffer.fill_(self.reads)
        self.reads += 1
        return ({"labels": self.buffer},)


def real_batches(count: int) -> list[dict[str, torch.Tensor]]:
    return [labels_batch(position, position + 1) for position in range(count)]


def hand_out(reader: Reader) -> list[tuple[Any, Entry]]:
    """Every item of the epoch with the entry it was handed out as."""
    out = []
    while True:
        try:
            item = reader.next_item()
        except StopIteration:
            return out
        assert reader.current is not None
        out.append((item, reader.current))


# ---------------------------------------------------------------------------------------------------------------------
# sized epochs and streams
# ---------------------------------------------------------------------------------------------------------------------


def test_sized_epoch_hands_out_every_batch_in_order_with_its_position_then_stops() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    reader.start_epoch(3)
    assert reader.sized and reader.length == 3 and reader.current is None and reader.position == 0

    out = hand_out(reader)

    assert [item for item, _ in out] == loader.items
    assert [entry.position for _, entry in out] == [0, 1, 2]
    assert not any(entry.filler or entry.aliased for _, entry in out)
    assert all(entry.batch is item[0] for item, entry in out)
    assert reader.position == 3
    assert not reader.exhausted  # the loader was never asked past the epoch's length
    with pytest.raises(StopIteration):
        reader.next_item()


def test_loader_running_out_early_repeats_its_last_real_batch_as_fillers_up_to_the_length() -> None:
    loader = FakeLoader(real_batches(2))
    reader = Reader(loader)
    reader.start_epoch(5)

    out = hand_out(reader)

    assert [entry.position for _, entry in out] == [0, 1, 2, 3, 4]
    assert [entry.filler for _, entry in out] == [False, False, True, True, True]
    assert all(item is loader.items[1] for item, _ in out[2:])  # the last real item, repeated
    assert all(entry.batch is None for _, entry in out[2:])
    assert reader.exhausted
    assert loader.reads == 2


def test_none_batch_becomes_a_filler_repeating_the_real_batch_before_it() -> None:
    first, third = labels_batch(1), labels_batch(3)
    reader = Reader(FakeLoader([first, None, third]))
    reader.start_epoch(3)

    out = hand_out(reader)

    assert [entry.filler for _, entry in out] == [False, True, False]
    assert out[1][0][0] is first
    assert out[2][1].batch is third


def test_none_batch_before_any_real_batch_repeats_the_first_real_one_which_is_still_trained_later() -> None:
    second, third = labels_batch(2), labels_batch(3)
    loader = FakeLoader([None, None, second, third])
    reader = Reader(loader)
    reader.start_epoch(4)

    out = hand_out(reader)

    assert [entry.filler for _, entry in out] == [True, True, False, False]
    assert out[0][0][0] is second and out[1][0][0] is second  # the first real batch, found ahead
    assert [entry.batch for _, entry in out[2:]] == [second, third]
    assert loader.reads == 4  # every item read once: the one found ahead was kept, not read again


def test_loader_without_any_batch_raises_stop_iteration_in_a_sized_epoch_and_a_stream() -> None:
    for length in (3, None):
        reader = Reader(FakeLoader([]))
        reader.start_epoch(length)
        with pytest.raises(StopIteration):
            reader.next_item()
        assert reader.exhausted


def test_loader_of_only_none_batches_has_nothing_to_repeat_and_raises_stop_iteration() -> None:
    reader = Reader(FakeLoader([None, None]))
    reader.start_epoch(2)
    with pytest.raises(StopIteration):
        reader.next_item()


def test_window_stop_is_k_apart_from_the_epoch_start_and_clipped_only_for_a_sized_epoch() -> None:
    reader = Reader(FakeLoader([]))
    reader.start_epoch(7)
    assert [reader.window_stop(start, 3) for start in (0, 2, 3, 5, 6)] == [3, 3, 6, 6, 7]  # a short last window
    reader.start_epoch(None)
    assert [reader.window_stop(start, 3) for start in (0, 2, 3, 5, 6)] == [3, 3, 6, 6, 9]


def test_stream_pads_with_fillers_until_its_agreed_end() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    reader.start_epoch(None)
    assert not reader.sized and reader.length == UNKNOWN_END

    reader.extend_to(2)
    first_window = hand_out(reader)
    assert [entry.position for _, entry in first_window] == [0, 1]

    reader.extend_to(6)  # the ranks agreed the stream goes on for two more windows
    rest = hand_out(reader)
    assert [entry.position for _, entry in rest] == [2, 3, 4, 5]
    assert [entry.filler for _, entry in rest] == [False, True, True, True]
    assert all(item is loader.items[2] for item, _ in rest[1:])


def test_stream_ends_at_its_agreed_end_even_with_batches_read_ahead_past_it() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    reader.start_epoch(None)
    reader.read_ahead(4)  # speculative: the stream's end is not agreed yet
    reader.extend_to(2)

    out = hand_out(reader)

    assert [entry.position for _, entry in out] == [0, 1]
    assert [item for item, _ in out] == loader.items[:2]
    with pytest.raises(StopIteration):
        reader.next_item()
    assert loader.reads == 4


def test_start_epoch_starts_a_new_pass_from_position_zero() -> None:
    loader = FakeLoader(real_batches(2))
    reader = Reader(loader)
    reader.start_epoch(3)
    hand_out(reader)
    assert reader.exhausted

    loader.restart()
    reader.start_epoch(2)

    assert reader.current is None and reader.position == 0 and not reader.exhausted
    out = hand_out(reader)
    assert [(entry.position, entry.filler) for _, entry in out] == [(0, False), (1, False)]


# ---------------------------------------------------------------------------------------------------------------------
# reading ahead
# ---------------------------------------------------------------------------------------------------------------------


def test_read_ahead_holds_batches_that_are_then_handed_out_without_reading_again() -> None:
    loader = FakeLoader(real_batches(5))
    reader = Reader(loader)
    reader.start_epoch(5)

    reader.read_ahead(4, at_most=1)
    assert loader.reads == 1
    reader.read_ahead(4, at_most=2)
    assert loader.reads == 3
    reader.read_ahead(4)
    assert loader.reads == 4
    reader.read_ahead(4)  # already held
    assert loader.reads == 4
    assert reader.position == 0  # nothing handed out yet

    out = hand_out(reader)
    assert [item for item, _ in out] == loader.items
    assert loader.reads == 5


def test_read_ahead_stops_at_a_sized_epochs_length() -> None:
    loader = FakeLoader(real_batches(5))
    reader = Reader(loader)
    reader.start_epoch(2)
    reader.read_ahead(10)
    assert loader.reads == 2


def test_entries_reads_ahead_to_the_range_and_returns_fewer_where_the_epoch_ends() -> None:
    loader = FakeLoader(real_batches(5))
    reader = Reader(loader)
    reader.start_epoch(3)

    window = reader.entries(0, 2)
    assert [entry.position for entry in window] == [0, 1]
    assert [entry.batch for entry in window] == [item[0] for item in loader.items[:2]]
    assert loader.reads == 2

    assert [entry.position for entry in reader.entries(1, 5)] == [1, 2]
    assert loader.reads == 3


def test_entry_of_the_batch_handed_out_drops_the_entries_before_it() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    reader.start_epoch(4)
    reader.read_ahead(3)
    reader.next_item()
    reader.next_item()

    assert reader.entry(1).position == 1
    assert [entry.position for entry in reader.entries(0, 3)] == [1, 2]
    with pytest.raises(RuntimeError, match=r"internal error: no batch at position 0 \(next: 2\)"):
        reader.entry(0)


def test_entry_of_the_next_position_reads_it_ahead() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    reader.start_epoch(4)
    assert reader.entry(0).position == 0
    assert loader.reads == 1
    assert reader.position == 0  # held, not handed out


def test_entry_several_positions_ahead_reads_ahead_to_it() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    reader.start_epoch(4)
    assert reader.entry(2).position == 2
    assert loader.reads == 3


def test_entry_past_the_epochs_end_is_an_internal_error() -> None:
    reader = Reader(FakeLoader(real_batches(2)))
    reader.start_epoch(2)
    with pytest.raises(RuntimeError, match="no batch at position 2"):
        reader.entry(2)


def test_has_real_from_reads_at_most_one_batch_ahead() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    reader.start_epoch(None)

    assert reader.has_real_from(0)
    assert loader.reads == 1
    assert reader.has_real_from(0)  # held already: no read
    assert loader.reads == 1

    reader.next_item()
    assert reader.has_real_from(1)
    assert loader.reads == 2


def test_has_real_from_is_false_once_only_fillers_remain() -> None:
    loader = FakeLoader(real_batches(1))
    reader = Reader(loader)
    reader.start_epoch(None)
    reader.next_item()

    assert not reader.has_real_from(1)  # the one read ahead is a filler: the loader ran out
    assert reader.exhausted
    assert [entry.filler for entry in reader.entries(1, 2)] == [True]
    assert not reader.has_real_from(1)


# ---------------------------------------------------------------------------------------------------------------------
# aliasing: loaders that refill one buffer
# ---------------------------------------------------------------------------------------------------------------------


def test_batch_read_ahead_while_the_one_in_flight_shares_its_buffer_is_aliased() -> None:
    reader = Reader(RefillingLoader(3))
    reader.start_epoch(3)
    reader.next_item()
    assert not reader.current.aliased  # type: ignore[union-attr]

    reader.read_ahead(2)  # in flight: the batch handed out last has not finished its backward

    (entry,) = reader.entries(1, 2)
    assert entry.aliased
    assert reader.refills and not reader.fresh


def test_batches_held_ahead_that_share_one_buffer_are_aliased_even_with_nothing_in_flight() -> None:
    reader = Reader(RefillingLoader(3))
    reader.start_epoch(3)
    reader.read_ahead(2, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 2)] == [False, True]


def test_refilling_loader_read_one_batch_at_a_time_is_never_aliased_but_not_fresh() -> None:
    reader = Reader(RefillingLoader(3))
    reader.start_epoch(3)
    out = hand_out(reader)
    assert not any(entry.aliased for _, entry in out)
    assert reader.refills
    assert not reader.fresh


def test_loader_yielding_fresh_tensors_is_fresh_after_two_batches_and_never_aliased() -> None:
    reader = Reader(FakeLoader(real_batches(4)))
    reader.start_epoch(4)
    assert not reader.fresh

    reader.next_item()
    assert not reader.fresh  # one batch says nothing yet
    reader.read_ahead(4)

    assert reader.fresh and not reader.refills
    assert not any(entry.aliased for entry in reader.entries(0, 4))


def test_the_same_batch_yielded_again_unchanged_is_not_aliased() -> None:
    """A one-batch epoch cycled (LitGPT's CycleIterator) or a dataset of stored tensors yields the very same tensors
    again: read ahead beside each other they are not a refilled buffer (nothing was overwritten). Control: the same
    tensor written in place between the reads (``fill_``, as a refilling loader does) is aliased."""
    labels = torch.tensor([1, 2, -100])
    reader = Reader(FakeLoader([{"labels": labels}] * 3))
    reader.start_epoch(3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, False, False]

    refilled = RefillingLoader(3)
    reader = Reader(refilled)
    reader.start_epoch(3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, True, True]


def test_batch_whose_tensor_repeats_the_previous_batchs_marks_the_loader_as_refilling() -> None:
    shared = torch.tensor([1, 2])
    reader = Reader(FakeLoader([{"labels": shared}, {"labels": shared, "extra": torch.ones(1)}]))
    reader.start_epoch(2)
    hand_out(reader)
    assert reader.refills and not reader.fresh


# ---------------------------------------------------------------------------------------------------------------------
# resume and adopted items
# ---------------------------------------------------------------------------------------------------------------------


def test_start_position_shifts_the_positions_at_the_first_batch_handed_out() -> None:
    starts = []

    def start() -> int:
        starts.append(5)
        return 5

    loader = FakeLoader(real_batches(3))
    reader = Reader(loader, start=start)
    reader.start_epoch(8)
    reader.read_ahead(2)
    assert [entry.position for entry in reader.entries(0, 2)] == [0, 1]  # counted from 0 until the first fetch

    reader.next_item()

    assert reader.current is not None and reader.current.position == 5
    assert [entry.position for entry in reader.entries(5, 7)] == [5, 6]
    assert reader.position == 6
    out = hand_out(reader)
    assert [(entry.position, entry.filler) for _, entry in out] == [(6, False), (7, False)]
    assert starts == [5]  # asked once per epoch

    loader.restart()
    reader.start_epoch(8)
    reader.next_item()
    assert starts == [5, 5]


def test_consumed_state_is_the_loaders_state_before_the_first_batch_held_ahead() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader, snapshot=loader.state)
    reader.start_epoch(4)
    assert reader.stateful
    assert not Reader(loader).stateful

    reader.read_ahead(3)
    assert reader.consumed_state() == {"read": 0}
    reader.next_item()
    assert reader.consumed_state() == {"read": 1}
    reader.next_item()
    reader.next_item()
    assert reader.consumed_state() == {"read": 3}  # nothing held: the loader's own state
    reader.read_ahead(4)
    assert reader.consumed_state() == {"read": 3}


def test_consumed_exhausted_only_once_the_real_batches_read_ahead_are_handed_out() -> None:
    reader = Reader(FakeLoader(real_batches(2)))
    reader.start_epoch(4)
    reader.read_ahead(3)
    assert reader.exhausted
    assert not reader.consumed_exhausted  # two real batches still to hand out

    reader.next_item()
    reader.next_item()
    assert reader.consumed_exhausted  # the next one held is a filler

    reader.next_item()
    assert reader.consumed_exhausted  # nothing held


def test_resumed_exhausted_rank_repeats_its_first_batch_only_as_a_filler() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    reader.start_epoch(3, resumed_exhausted=True)

    out = hand_out(reader)

    assert [entry.filler for _, entry in out] == [True, True, True]
    assert all(item is loader.items[0] for item, _ in out)
    assert loader.reads == 1
    assert reader.exhausted


def test_adopted_items_come_before_the_loaders_own() -> None:
    adopted = [(labels_batch(7),), (labels_batch(8),)]
    loader = FakeLoader(real_batches(2))
    reader = Reader(loader)
    reader.adopt(adopted)
    reader.start_epoch(4)

    out = hand_out(reader)

    assert [item for item, _ in out] == [*adopted, *loader.items]
    assert [entry.position for _, entry in out] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------------------
# a rank's own limit (Lightning's `limit_train_batches`), and a loader that yields past its sized end
# ---------------------------------------------------------------------------------------------------------------


def test_a_rank_limited_below_the_epoch_repeats_a_filler_after_its_limit() -> None:
    batches = real_batches(5)
    loader = FakeLoader(batches)
    reader = Reader(loader)
    reader.start_epoch(4, limit=2)
    entries = reader.entries(0, 4)
    assert [entry.filler for entry in entries] == [False, False, True, True]
    assert [reader.next_item()[0] for _ in range(4)] == [batches[0], batches[1], batches[1], batches[1]]
    assert loader.reads == 2, "nothing past the limit is read"
    assert not reader.yields_past_end(), "a limited epoch ends before the loader does"


@pytest.mark.parametrize(("yielded", "more"), [(4, False), (6, True)])
def test_yields_past_end_reads_one_batch_past_the_sized_epoch(yielded: int, more: bool) -> None:
    loader = FakeLoader(real_batches(yielded))
    reader = Reader(loader, snapshot=loader.state)
    reader.start_epoch(4)
    for _ in range(4):
        reader.next_item()
    state = reader.consumed_state()
    assert reader.yields_past_end() is more
    assert not reader.exhausted and not reader.consumed_exhausted, "the peek leaves the reader's state alone"
    assert loader.reads == 4 + more and state == {"read": 4}


def test_yields_past_end_never_reads_from_a_loader_that_refills_its_buffer() -> None:
    loader = RefillingLoader(6)
    reader = Reader(loader)
    reader.start_epoch(4)
    for _ in range(4):
        reader.next_item()
    assert not reader.yields_past_end()
    assert loader.reads == 4, "a read would overwrite the batch in flight"
