"""The reader and its epoch over fake loaders: positions, fillers, read-ahead, aliasing, resume, a pass's end and a
loader that yields past its length, with no process and no model.

A fake loader is a callable returning ``(batch,)`` items, raising ``StopIteration`` at its end, as the reader's
``raw_next`` does under Fabric. The reader never ends a pass by itself: an :class:`Epoch` over it does (one process,
a channel that runs no collective).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from token_mean import DenominatorError
from token_mean._epoch import UNKNOWN_END, Epoch
from token_mean._layout import World
from token_mean._problems import Problem
from token_mean._reader import Entry, Reader
from token_mean._record import Channel, Slot

MODE: Any = SimpleNamespace(channel=Channel(World.single()))  # what an epoch asks of its mode outside a window


def begin(reader: Reader, length: int | None, resumed_exhausted: bool = False, limit: int | None = None,
          own_length: int | None = None) -> Epoch:
    """A new pass over ``reader``, ``length`` batches long (None: a stream)."""
    reader.restart(resumed_exhausted, limit)
    return Epoch(reader, MODE, length, "epoch 0", own_length)


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


def hand_out(epoch: Epoch) -> list[tuple[Any, Entry]]:
    """Every item of the epoch with the entry it was handed out as."""
    out = []
    while True:
        try:
            item = epoch.next_item()
        except StopIteration:
            return out
        assert epoch.reader.current is not None
        out.append((item, epoch.reader.current))


# ---------------------------------------------------------------------------------------------------------------------
# sized epochs and streams
# ---------------------------------------------------------------------------------------------------------------------


def test_sized_epoch_hands_out_every_batch_in_order_with_its_position_then_stops() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    epoch = begin(reader, 3)
    assert epoch.sized and epoch.length == 3 and reader.current is None and reader.position == 0

    out = hand_out(epoch)

    assert [item for item, _ in out] == loader.items
    assert [entry.position for _, entry in out] == [0, 1, 2]
    assert not any(entry.filler or entry.aliased for _, entry in out)
    assert all(entry.batch is item[0] for item, entry in out)
    assert reader.position == 3
    assert not reader.exhausted  # the loader was never asked past the epoch's length
    with pytest.raises(StopIteration):
        epoch.next_item()


def test_loader_running_out_early_repeats_its_last_real_batch_as_fillers_up_to_the_length() -> None:
    loader = FakeLoader(real_batches(2))
    reader = Reader(loader)
    epoch = begin(reader, 5)

    out = hand_out(epoch)

    assert [entry.position for _, entry in out] == [0, 1, 2, 3, 4]
    assert [entry.filler for _, entry in out] == [False, False, True, True, True]
    assert all(item is loader.items[1] for item, _ in out[2:])  # the last real item, repeated
    assert all(entry.batch is None for _, entry in out[2:])
    assert reader.exhausted
    assert loader.reads == 2


def test_none_batch_becomes_a_filler_repeating_the_real_batch_before_it() -> None:
    first, third = labels_batch(1), labels_batch(3)
    reader = Reader(FakeLoader([first, None, third]))
    epoch = begin(reader, 3)

    out = hand_out(epoch)

    assert [entry.filler for _, entry in out] == [False, True, False]
    assert out[1][0][0] is first
    assert out[2][1].batch is third


def test_none_batch_before_any_real_batch_repeats_the_first_real_one_which_is_still_trained_later() -> None:
    second, third = labels_batch(2), labels_batch(3)
    loader = FakeLoader([None, None, second, third])
    reader = Reader(loader)
    epoch = begin(reader, 4)

    out = hand_out(epoch)

    assert [entry.filler for _, entry in out] == [True, True, False, False]
    assert out[0][0][0] is second and out[1][0][0] is second  # the first real batch, found ahead
    assert [entry.batch for _, entry in out[2:]] == [second, third]
    assert loader.reads == 4  # every item read once: the one found ahead was kept, not read again


def test_loader_without_any_batch_raises_stop_iteration_in_a_sized_epoch_and_a_stream() -> None:
    for length in (3, None):
        reader = Reader(FakeLoader([]))
        epoch = begin(reader, length)
        with pytest.raises(StopIteration):
            epoch.next_item()
        assert reader.exhausted


def test_loader_of_only_none_batches_has_nothing_to_repeat_and_raises_stop_iteration() -> None:
    reader = Reader(FakeLoader([None, None]))
    epoch = begin(reader, 2)
    with pytest.raises(StopIteration):
        epoch.next_item()


def test_window_stop_is_k_apart_from_the_epoch_start_and_clipped_only_for_a_sized_epoch() -> None:
    reader = Reader(FakeLoader([]))
    epoch = begin(reader, 7)
    assert [epoch.window_stop(start, 3) for start in (0, 2, 3, 5, 6)] == [3, 3, 6, 6, 7]  # a short last window
    epoch = begin(reader, None)
    assert [epoch.window_stop(start, 3) for start in (0, 2, 3, 5, 6)] == [3, 3, 6, 6, 9]


def test_stream_pads_with_fillers_until_its_agreed_end() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    epoch = begin(reader, None)
    assert not epoch.sized and epoch.length == UNKNOWN_END

    epoch.length = 2  # the ranks agreed the stream ends after its first window (`Epoch.after`)
    first_window = hand_out(epoch)
    assert [entry.position for _, entry in first_window] == [0, 1]

    epoch.length = 6  # ... or two windows later
    rest = hand_out(epoch)
    assert [entry.position for _, entry in rest] == [2, 3, 4, 5]
    assert [entry.filler for _, entry in rest] == [False, True, True, True]
    assert all(item is loader.items[2] for item, _ in rest[1:])


def test_stream_ends_at_its_agreed_end_even_with_batches_read_ahead_past_it() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    epoch = begin(reader, None)
    reader.read_ahead(4)  # speculative: the stream's end is not agreed yet
    epoch.length = 2  # agreed after the first window

    out = hand_out(epoch)

    assert [entry.position for _, entry in out] == [0, 1]
    assert [item for item, _ in out] == loader.items[:2]
    with pytest.raises(StopIteration):
        epoch.next_item()
    assert loader.reads == 4


def test_start_epoch_starts_a_new_pass_from_position_zero() -> None:
    loader = FakeLoader(real_batches(2))
    reader = Reader(loader)
    epoch = begin(reader, 3)
    hand_out(epoch)
    assert reader.exhausted

    loader.restart()
    epoch = begin(reader, 2)

    assert reader.current is None and reader.position == 0 and not reader.exhausted
    out = hand_out(epoch)
    assert [(entry.position, entry.filler) for _, entry in out] == [(0, False), (1, False)]


# ---------------------------------------------------------------------------------------------------------------------
# reading ahead
# ---------------------------------------------------------------------------------------------------------------------


def test_read_ahead_holds_batches_that_are_then_handed_out_without_reading_again() -> None:
    loader = FakeLoader(real_batches(5))
    reader = Reader(loader)
    epoch = begin(reader, 5)

    reader.read_ahead(4, at_most=1)
    assert loader.reads == 1
    reader.read_ahead(4, at_most=2)
    assert loader.reads == 3
    reader.read_ahead(4)
    assert loader.reads == 4
    reader.read_ahead(4)  # already held
    assert loader.reads == 4
    assert reader.position == 0  # nothing handed out yet

    out = hand_out(epoch)
    assert [item for item, _ in out] == loader.items
    assert loader.reads == 5


def test_read_ahead_stops_at_a_sized_epochs_length() -> None:
    loader = FakeLoader(real_batches(5))
    reader = Reader(loader)
    epoch = begin(reader, 2)
    reader.read_ahead(epoch.window_stop(0, 10))
    assert loader.reads == 2


def test_entries_read_ahead_to_the_range_and_a_window_stops_where_the_epoch_ends() -> None:
    loader = FakeLoader(real_batches(5))
    reader = Reader(loader)
    epoch = begin(reader, 3)

    window = reader.entries(0, epoch.window_stop(0, 2))
    assert [entry.position for entry in window] == [0, 1]
    assert [entry.batch for entry in window] == [item[0] for item in loader.items[:2]]
    assert loader.reads == 2

    assert [entry.position for entry in reader.entries(1, epoch.window_stop(1, 5))] == [1, 2]
    assert loader.reads == 3


def test_entry_of_the_batch_handed_out_drops_the_entries_before_it() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    epoch = begin(reader, 4)
    reader.read_ahead(3)
    epoch.next_item()
    epoch.next_item()

    assert reader.entry(1).position == 1
    assert [entry.position for entry in reader.entries(0, 3)] == [1, 2]
    with pytest.raises(RuntimeError, match=r"internal error: no batch at position 0 \(next: 2\)"):
        reader.entry(0)


def test_entry_of_the_next_position_reads_it_ahead() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    begin(reader, 4)
    assert reader.entry(0).position == 0
    assert loader.reads == 1
    assert reader.position == 0  # held, not handed out


def test_entry_several_positions_ahead_reads_ahead_to_it() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader)
    begin(reader, 4)
    assert reader.entry(2).position == 2
    assert loader.reads == 3


def test_entry_past_the_epochs_end_is_an_internal_error() -> None:
    reader = Reader(FakeLoader(real_batches(2)))
    epoch = begin(reader, 2)
    with pytest.raises(RuntimeError, match="no batch at position 2"):
        epoch.micro_batch(2, 1, lambda: 0)


def test_has_real_from_reads_at_most_one_batch_ahead() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    epoch = begin(reader, None)

    assert reader.has_real_from(0)
    assert loader.reads == 1
    assert reader.has_real_from(0)  # held already: no read
    assert loader.reads == 1

    epoch.next_item()
    assert reader.has_real_from(1)
    assert loader.reads == 2


def test_has_real_from_is_false_once_only_fillers_remain() -> None:
    loader = FakeLoader(real_batches(1))
    reader = Reader(loader)
    epoch = begin(reader, None)
    epoch.next_item()

    assert not reader.has_real_from(1)  # the one read ahead is a filler: the loader ran out
    assert reader.exhausted
    assert [entry.filler for entry in reader.entries(1, 2)] == [True]
    assert not reader.has_real_from(1)


# ---------------------------------------------------------------------------------------------------------------------
# aliasing: loaders that refill one buffer
# ---------------------------------------------------------------------------------------------------------------------


def test_batch_read_ahead_while_the_one_in_flight_shares_its_buffer_is_aliased() -> None:
    reader = Reader(RefillingLoader(3))
    epoch = begin(reader, 3)
    epoch.next_item()
    assert not reader.current.aliased  # type: ignore[union-attr]

    reader.read_ahead(2)  # in flight: the batch handed out last has not finished its backward

    (entry,) = reader.entries(1, 2)
    assert entry.aliased
    assert reader.refills and not reader.fresh


def test_batches_held_ahead_that_share_one_buffer_are_aliased_even_with_nothing_in_flight() -> None:
    reader = Reader(RefillingLoader(3))
    begin(reader, 3)
    reader.read_ahead(2, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 2)] == [False, True]


def test_refilling_loader_read_one_batch_at_a_time_is_never_aliased_but_not_fresh() -> None:
    reader = Reader(RefillingLoader(3))
    epoch = begin(reader, 3)
    out = hand_out(epoch)
    assert not any(entry.aliased for _, entry in out)
    assert reader.refills
    assert not reader.fresh


def test_loader_yielding_fresh_tensors_is_fresh_after_two_batches_and_never_aliased() -> None:
    reader = Reader(FakeLoader(real_batches(4)))
    epoch = begin(reader, 4)
    assert not reader.fresh

    epoch.next_item()
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
    begin(reader, 3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, False, False]

    refilled = RefillingLoader(3)
    reader = Reader(refilled)
    begin(reader, 3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, True, True]


def test_batch_whose_tensor_repeats_the_previous_batchs_marks_the_loader_as_refilling() -> None:
    shared = torch.tensor([1, 2])
    reader = Reader(FakeLoader([{"labels": shared}, {"labels": shared, "extra": torch.ones(1)}]))
    epoch = begin(reader, 2)
    hand_out(epoch)
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
    epoch = begin(reader, 8)
    reader.read_ahead(2)
    assert [entry.position for entry in reader.entries(0, 2)] == [0, 1]  # counted from 0 until the first fetch

    epoch.next_item()

    assert reader.current is not None and reader.current.position == 5
    assert [entry.position for entry in reader.entries(5, 7)] == [5, 6]
    assert reader.position == 6
    out = hand_out(epoch)
    assert [(entry.position, entry.filler) for _, entry in out] == [(6, False), (7, False)]
    assert starts == [5]  # asked once per epoch

    loader.restart()
    epoch = begin(reader, 8)
    epoch.next_item()
    assert starts == [5, 5]


def test_consumed_state_is_the_loaders_state_before_the_first_batch_held_ahead() -> None:
    loader = FakeLoader(real_batches(4))
    reader = Reader(loader, snapshot=loader.state)
    epoch = begin(reader, 4)
    assert reader.stateful
    assert not Reader(loader).stateful

    reader.read_ahead(3)
    assert reader.consumed_state() == {"read": 0}
    epoch.next_item()
    assert reader.consumed_state() == {"read": 1}
    epoch.next_item()
    epoch.next_item()
    assert reader.consumed_state() == {"read": 3}  # nothing held: the loader's own state
    reader.read_ahead(4)
    assert reader.consumed_state() == {"read": 3}


def test_consumed_exhausted_only_once_the_real_batches_read_ahead_are_handed_out() -> None:
    reader = Reader(FakeLoader(real_batches(2)))
    epoch = begin(reader, 4)
    reader.read_ahead(3)
    assert reader.exhausted
    assert not reader.consumed_exhausted  # two real batches still to hand out

    epoch.next_item()
    epoch.next_item()
    assert reader.consumed_exhausted  # the next one held is a filler

    epoch.next_item()
    assert reader.consumed_exhausted  # nothing held


def test_resumed_exhausted_rank_repeats_its_first_batch_only_as_a_filler() -> None:
    loader = FakeLoader(real_batches(3))
    reader = Reader(loader)
    epoch = begin(reader, 3, resumed_exhausted=True)

    out = hand_out(epoch)

    assert [entry.filler for _, entry in out] == [True, True, True]
    assert all(item is loader.items[0] for item, _ in out)
    assert loader.reads == 1
    assert reader.exhausted


def test_adopted_items_come_before_the_loaders_own() -> None:
    adopted = [(labels_batch(7),), (labels_batch(8),)]
    loader = FakeLoader(real_batches(2))
    reader = Reader(loader)
    reader.adopt(adopted)
    epoch = begin(reader, 4)

    out = hand_out(epoch)

    assert [item for item, _ in out] == [*adopted, *loader.items]
    assert [entry.position for _, entry in out] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------------------
# a rank's own limit (Lightning's `limit_train_batches`), and a loader that yields past its sized end
# ---------------------------------------------------------------------------------------------------------------


def test_a_rank_limited_below_the_epoch_repeats_a_filler_after_its_limit() -> None:
    batches = real_batches(5)
    loader = FakeLoader(batches)
    reader = Reader(loader)
    epoch = begin(reader, 4, limit=2)
    entries = reader.entries(0, 4)
    assert [entry.filler for entry in entries] == [False, False, True, True]
    assert [epoch.next_item()[0] for _ in range(4)] == [batches[0], batches[1], batches[1], batches[1]]
    assert loader.reads == 2, "nothing past the limit is read"
    assert epoch.pass_end(4, peek=False) == ({}, []), "a limited epoch ends before the loader does: no check"


LONGER = Problem.LONGER_THAN_LEN


@pytest.mark.parametrize(("yielded", "more"), [(4, False), (6, True)])
def test_the_last_window_asks_a_fresh_loader_for_one_item_past_its_length(yielded: int, more: bool) -> None:
    loader = FakeLoader(real_batches(yielded))
    reader = Reader(loader, snapshot=loader.state)
    epoch = begin(reader, 4, own_length=4)
    for _ in range(4):
        epoch.next_item()
    state = reader.consumed_state()
    assert epoch.pass_end(3, peek=False) == ({}, []), "not the pass's last window: nothing asked"
    host, problems = epoch.pass_end(4, peek=False)
    assert host == {} and [problem for problem, _ in problems] == ([LONGER] if more else [])
    assert not reader.consumed_exhausted, "what the check reads is dropped"
    assert loader.reads == 4 + more and state == {"read": 4}


def test_a_loader_that_refills_its_buffer_is_asked_only_after_the_last_backward() -> None:
    """Before the last backward a read would overwrite the batch in flight: the rank says it is unsure (the record's
    END_UNREAD slot), and after the backward every rank asks in one more collective (``Epoch.apply_window_end``)."""
    loader = RefillingLoader(6)
    reader = Reader(loader)
    epoch = begin(reader, 4, own_length=4)
    for _ in range(4):
        epoch.next_item()
    assert epoch.pass_end(4, peek=False) == ({Slot.END_UNREAD: 1.0}, [])
    assert loader.reads == 4, "a read would overwrite the batch in flight"
    window: Any = SimpleNamespace(stop=4, accumulate=2, where="the window")
    with pytest.raises(DenominatorError, match=r"the training loader yielded more batches than its `len\(\)`"):
        epoch.apply_window_end(window, 0.0, end_unread=True)
    assert loader.reads == 5


@pytest.mark.parametrize(("yielded", "more"), [(7, False), (8, True)])
def test_a_loader_restarted_by_a_resume_is_asked_for_one_item_past_its_whole_length(yielded: int, more: bool) -> None:
    """Resumed at batch 3 from a loader without a state, Lightning restarts it from its first batch and trains 4 of
    its 7 (plain Lightning too): the loader then still holds 3 by design, and only an 8th says its `len()` is short.
    Control: read one item past the pass (what a stateful loader is asked) would flag the 7-batch loader."""
    loader = FakeLoader(real_batches(yielded))
    reader = Reader(loader, start=lambda: 3)
    epoch = begin(reader, 7, own_length=7)
    for _ in range(4):
        epoch.next_item()
    assert reader.resumed_without_state and reader.undrawn_start == 0
    assert epoch.pass_end(7, peek=False) == ({Slot.END_UNREAD: 1.0}, []), "it is read after the last backward"
    window: Any = SimpleNamespace(stop=7, accumulate=2, where="the window")
    if more:
        with pytest.raises(DenominatorError, match="more than its `len\\(\\)` of 7"):
            epoch.apply_window_end(window, 0.0, end_unread=True)
    else:
        epoch.apply_window_end(window, 0.0, end_unread=True)
    assert loader.reads == yielded
    assert loader.reads > 4 + 1, "the control: one item past the pass says nothing here"


def test_a_resumed_stateful_or_skipping_loader_is_asked_for_one_item_past_what_it_still_holds() -> None:
    """A loader that resumed past its first 3 items (its state restored, or Fabric skipping them) yields the other
    4 of its 7: one more says its `len()` is short."""
    for reader_of in (lambda loader: Reader(loader, snapshot=loader.state, start=lambda: 3),
                      lambda loader: Reader(loader, start=lambda: 3, skipped=True)):
        loader = FakeLoader(real_batches(5))  # what remains after the 3 skipped: 4 in the length, and 1 more
        reader = reader_of(loader)
        epoch = begin(reader, 7, own_length=7)
        for _ in range(4):
            epoch.next_item()
        assert reader.undrawn_start == 3 and not reader.resumed_without_state
        _, problems = epoch.pass_end(7, peek=False)
        assert [problem for problem, _ in problems] == [LONGER]


def test_batches_that_overlap_only_through_views_of_the_same_unchanged_tensors_are_not_aliased() -> None:
    """A batch whose labels are a view of its inputs, yielded again unchanged, overlaps itself but overwrites
    nothing; a ring buffer that yields disjoint slices of one buffer shares no bytes between batches either.
    Control: a slice that overlaps the one held before it is aliased."""
    ids = torch.arange(8)
    reader = Reader(FakeLoader([{"ids": ids, "labels": ids[1:]}] * 3))
    begin(reader, 3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, False, False]

    ring = torch.arange(12)
    reader = Reader(FakeLoader([{"labels": ring[start : start + 4]} for start in (0, 4, 8)]))
    begin(reader, 3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, False, False]
    assert not reader.refills

    reader = Reader(FakeLoader([{"labels": ring[start : start + 4]} for start in (0, 2, 4)]))
    begin(reader, 3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, True, True]


def test_unchanged_is_the_very_tensors_handed_out_last_at_their_versions() -> None:
    labels = torch.tensor([1, 2, -100])
    reader = Reader(FakeLoader([{"labels": labels}]))
    epoch = begin(reader, 1)
    (batch,) = epoch.next_item()
    assert reader.unchanged({"labels": labels})  # a new container around the same tensor (Lightning's transfer)
    assert not reader.unchanged({"labels": labels.clone()})
    labels[0] = -100  # a hook that writes the labels in place
    assert not reader.unchanged(batch)


def test_a_strided_view_reaches_every_byte_between_its_first_and_last_element() -> None:
    buffer = torch.arange(12).reshape(3, 4)
    column = buffer[:, 0]  # elements 0, 4, 8: non-contiguous, it reaches bytes [0, 9 elements)
    inside, after = buffer[1, 1:], buffer[2, 1:]  # elements 5..7 (between the column's), 9..11 (past it)
    reader = Reader(FakeLoader([{"labels": column}, {"labels": after}, {"labels": inside}]))
    begin(reader, 3)
    reader.read_ahead(3, in_flight=False)
    assert [entry.aliased for entry in reader.entries(0, 3)] == [False, False, True]


def test_unchanged_is_false_for_another_number_of_tensors_and_before_any_batch() -> None:
    labels, mask = torch.tensor([1, -100]), torch.tensor([1, 0])
    reader = Reader(FakeLoader([{"labels": labels}]))
    assert not reader.unchanged({"labels": labels})  # nothing handed out yet
    epoch = begin(reader, 1)
    epoch.next_item()
    assert reader.unchanged({"labels": labels})
    assert not reader.unchanged({"labels": labels, "mask": mask})
    assert not reader.unchanged({})
