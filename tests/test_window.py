"""The record, its reduction and the window, in one process: fake multi-rank worlds are summed by hand.

A ``World`` with ``distributed=False`` runs no collective, whatever its size: each rank's record is built by a
``Channel`` over ``World(size=P, rank=r)``, and the test sums the records itself, as the SUM all-reduce would; where
fake ranks gather their records (the failure path), each reads in a thread of its own and ``_hub.Hub`` stands in for
the ``all_gather``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _hub import Hub, in_threads
from torch import Tensor

from token_mean import DenominatorError, WindowStats
from token_mean._layout import World
from token_mean._problems import Problem
from token_mean._record import (
    MARKS,
    RECORD_SIZE,
    Channel,
    Exchange,
    Kind,
    Mark,
    Reduced,
    Slot,
    raise_lines,
)
from token_mean._window import Window

CPU = torch.device("cpu")
STEP = "optimizer step 1 (epoch 0"
NAN = float("nan")


def world(size: int, rank: int) -> World:
    return World(size=size, rank=rank, device=CPU)


# the record's layout: the slots, then per mark how many ranks set it
def ranks_slot(mark: Mark) -> int:
    return len(Slot) + MARKS.index(mark)


def scalar(value: float) -> Tensor:
    return torch.tensor(value, dtype=torch.float64)


class RecordingChannel(Channel):
    """A channel that keeps the exchanges it starts and the records it gathers (the failure path), so a test can read
    (or replace) what a window sent; with ``gathering``, fake ranks gather each other's records."""

    def __init__(self, world: World, rank_counts: bool = False, hub: Hub | None = None) -> None:
        super().__init__(world, rank_counts)
        self.exchanges: list[Exchange] = []
        self.gathered: list[Tensor] = []
        self._hub = hub

    def _exchange(self, kind: Kind, op: Any, contents: tuple[Any, ...], named: dict[str, Any]) -> Exchange:
        exchange = super()._exchange(kind, op, contents, named)
        self.exchanges.append(exchange)
        return exchange

    def _all_gather(self, record: Tensor) -> Tensor:
        self.gathered.append(record)
        return super()._all_gather(record) if self._hub is None else self._hub.all_gather(self.world.rank, record)


def fake_ranks(size: int) -> tuple[list[RecordingChannel], Hub]:
    """One channel per fake rank, gathering each other's records through one hub."""
    hub = Hub(size)
    return [RecordingChannel(world(size, rank), hub=hub) for rank in range(size)], hub


def all_reduce(exchanges: list[Exchange]) -> None:
    """What the SUM all-reduce does to the ranks' records: each one becomes their sum."""
    total = torch.stack([exchange.record for exchange in exchanges]).sum(0)
    for exchange in exchanges:
        exchange.record = total.clone()


def Values(host: dict[Slot, float] | None = None, device: Any = (), flags: frozenset[Problem] = frozenset(),
           device_flags: Any = ()) -> dict[str, Any]:
    """What one rank puts into a record, as ``Channel.record``'s keywords."""
    return {"host": host or {}, "device": device, "flags": flags, "device_flags": device_flags}


def reduced_over(values: list[dict[str, Any]], kinds: list[Kind] | None = None, earlier: list[int] | None = None,
                 kind: Kind = Kind.WINDOW) -> list[Reduced]:
    """Every rank's reading of the sum of the ranks' records (rank r at ``kinds[r]``, after ``earlier[r]`` other
    collectives on its channel)."""
    size = len(values)
    records = []
    for rank in range(size):
        channel = Channel(world(size, rank))
        for _ in range((earlier or [0] * size)[rank]):
            channel.start(kind)
        records.append(channel.record((kinds or [kind] * size)[rank], **values[rank]))
    total = torch.stack(records).sum(0).tolist()
    rows = [record.tolist() for record in records]  # as the failure path gathers them
    return [Reduced(kind, total, world(size, rank), [], rows=rows) for rank in range(size)]


def flagged_on(ranks: set[int], size: int, problem: Problem = Problem.BAD_LOSS) -> list[dict[str, Any]]:
    return [Values(flags=frozenset({problem}) if rank in ranks else frozenset()) for rank in range(size)]


def line(who: str, problem: Problem) -> str:
    return f"{who}: {problem.what}. Fix: {problem.fix}"


def window(channel: Channel | None = None, reduction: str = "mean", **judges: bool) -> Window:
    return Window(channel or Channel(World.single()), 0, 4, 4, STEP, reduction, **judges)


def read(win: Window, host: dict[Slot, float] | None = None) -> tuple[Reduced, float]:
    """The window's exchange started after its last forward, and read after its last backward."""
    win.close(host or {})
    return win.read()


# ---------------------------------------------------------------------------------------------------------------------
# the record
# ---------------------------------------------------------------------------------------------------------------------


def test_record_holds_host_values_in_their_slots_and_the_kinds_mark() -> None:
    record = Channel(world(4, 2)).record(Kind.WINDOW, **Values({Slot.COUNT: 3.0, Slot.LENGTH: 2.0}))

    assert record.dtype == torch.float64 and record.shape == (RECORD_SIZE,)
    assert record[Slot.COUNT] == 3.0 and record[Slot.LENGTH] == 2.0
    assert record[ranks_slot(Kind.WINDOW)] == 1.0
    others = [mark for mark in MARKS if mark is not Kind.WINDOW]
    assert all(record[ranks_slot(mark)] == 0.0 for mark in others)

@pytest.mark.parametrize("rank_counts", [False, True])
def test_a_vector_of_slots_adds_like_its_scalars_and_the_rank_block_copies_count_from_count_slots(
    rank_counts: bool,
) -> None:
    channel = Channel(world(3, 1), rank_counts=rank_counts)
    count, loss, aux = (torch.tensor(v, dtype=torch.float64) for v in (5.0, 2.5, 0.75))
    scalars = channel.record(Kind.WINDOW, **Values({Slot.LENGTH: 1.0}, [(Slot.COUNT, count), (Slot.LOSS_SUM, loss),
                                                                      (Slot.AUX_SUM, aux)]))
    slots = channel.count_slots
    vector = torch.stack([count] * len(slots) + [loss])
    mixed = channel.record(Kind.WINDOW, **Values({Slot.LENGTH: 1.0}, [((*slots, Slot.LOSS_SUM), vector),
                                                                     (Slot.AUX_SUM, aux)]))

    assert torch.equal(mixed, scalars)
    assert mixed[Slot.COUNT] == 5.0 and mixed[Slot.LOSS_SUM] == 2.5 and mixed[Slot.AUX_SUM] == 0.75
    assert slots == ((Slot.COUNT, RECORD_SIZE + 1) if rank_counts else (Slot.COUNT,))
    assert mixed.shape == (RECORD_SIZE + (3 if rank_counts else 0),)
    if rank_counts:
        assert mixed[RECORD_SIZE + 1] == 5.0 and mixed[RECORD_SIZE] == 0.0 and mixed[RECORD_SIZE + 2] == 0.0



def test_the_zero_is_made_once_per_channel_and_a_window_of_fillers_leaves_it_zero() -> None:
    channel = Channel(World.single())
    second = Window(channel, 2, 4, 2, STEP, "mean")
    assert channel.zero() is channel.zero()
    for _ in range(2):  # fillers: the zero is their count, and no loss
        second.add(channel.zero(), None, filler=True)
    reduced, local = read(second)
    assert local == 0.0 and reduced[Slot.LOSS_SUM] == 0.0
    assert channel.zero().item() == 0.0 and channel.zero().dtype == torch.float64


def test_sequence_counts_the_collectives_started_on_the_channel() -> None:
    channel = Channel(World.single())
    assert channel.record(Kind.WINDOW)[Slot.SEQUENCE] == 0.0
    assert channel.record(Kind.WINDOW)[Slot.SEQUENCE] == 0.0  # building a record is no collective

    records = [channel.start(Kind.WINDOW).record for _ in range(3)]
    records.append(channel.reduce(Kind.STREAM_END).values)  # type: ignore[arg-type]

    assert [record[Slot.SEQUENCE] for record in records] == [0.0, 1.0, 2.0, 3.0]
    assert [record[Slot.SEQUENCE_SQUARED] for record in records] == [0.0, 1.0, 4.0, 9.0]


def test_device_values_are_added_to_the_host_values_of_their_slots() -> None:
    values = Values({Slot.COUNT: 1.0}, [(Slot.COUNT, torch.tensor(2)), (Slot.LOSS_SUM, torch.tensor(0.5))])
    record = Channel(World.single()).record(Kind.WINDOW, **values)
    assert record[Slot.COUNT] == 3.0
    assert record[Slot.LOSS_SUM] == 0.5


def test_device_flags_set_a_mark_only_when_true() -> None:
    values = Values(device_flags=[(Problem.BAD_LOSS, torch.tensor(True)), (Problem.COUNT_RANGE, torch.tensor(False))])
    record = Channel(world(5, 3)).record(Kind.WINDOW, **values)
    assert record[ranks_slot(Problem.BAD_LOSS)] == 1.0
    assert record[ranks_slot(Problem.COUNT_RANGE)] == 0.0


def test_problem_flagged_on_the_host_and_on_the_device_is_counted_once() -> None:
    values = Values(flags=frozenset({Problem.BAD_LOSS}), device_flags=[(Problem.BAD_LOSS, torch.tensor(True))])
    record = Channel(world(5, 3)).record(Kind.WINDOW, **values)
    assert record[ranks_slot(Problem.BAD_LOSS)] == 1.0


def test_problem_twice_among_device_flags_is_still_one_rank() -> None:
    true = torch.tensor(True)
    record = Channel(world(5, 3)).record(Kind.WINDOW, **Values(device_flags=[(Problem.BAD_LOSS, true)] * 2))
    assert record[ranks_slot(Problem.BAD_LOSS)] == 1.0


def test_rank_counts_block_holds_each_ranks_count_in_its_own_slot() -> None:
    size = 3
    records = []
    for rank in range(size):
        channel = Channel(world(size, rank), rank_counts=True)
        host = {Slot.COUNT: float(rank)}
        records.append(channel.record(Kind.WINDOW, **Values(host, [(Slot.COUNT, scalar(10.0))])))
    assert all(record.shape == (RECORD_SIZE + size,) for record in records)
    assert records[1][RECORD_SIZE:].tolist() == [0.0, 11.0, 0.0]

    total = torch.stack(records).sum(0).tolist()
    assert Reduced(Kind.WINDOW, total, world(size, 0), []).rank_counts() == (10.0, 11.0, 12.0)
    plain = Channel(World.single()).record(Kind.WINDOW).tolist()
    assert Reduced(Kind.WINDOW, plain, World.single(), []).rank_counts() is None


# ---------------------------------------------------------------------------------------------------------------------
# the reduced record: who raised what
# ---------------------------------------------------------------------------------------------------------------------


def test_problem_of_one_rank_is_named_on_every_rank() -> None:
    for reduced in reduced_over(flagged_on({3}, 6)):
        assert reduced.in_step()
        assert reduced.ranks_with(Problem.BAD_LOSS) == (1, [3])
        assert reduced.lines() == [line("rank 3", Problem.BAD_LOSS)]


def test_problem_of_several_ranks_names_them_all() -> None:
    (reduced, *_) = reduced_over(flagged_on({0, 5}, 6))
    assert reduced.lines() == [line("ranks 0, 5", Problem.BAD_LOSS)]


def test_every_rank_is_named_however_many() -> None:
    (reduced, *_) = reduced_over(flagged_on(set(range(3, 70)), 70))
    assert reduced.lines() == [line("ranks " + ", ".join(map(str, range(3, 70))), Problem.BAD_LOSS)]


def test_without_gathered_rows_the_ranks_are_counted() -> None:
    (summed, *_) = reduced_over(flagged_on({1, 4}, 6))
    reduced = Reduced(Kind.WINDOW, summed.values, world(6, 0), [])
    assert reduced.lines() == [line("2 ranks", Problem.BAD_LOSS)]


def test_the_records_are_gathered_only_where_the_sum_shows_a_problem() -> None:
    """The common path reads the sum alone; a sum that shows a problem gathers the records once, to name the ranks."""
    (clean, *_) = reduced_over([Values(), Values()])
    (flagged, *_) = reduced_over(flagged_on({1}, 2))
    gathers: list[Reduced] = []

    def gather(reduced: Reduced) -> Callable[[], Reduced]:
        return lambda: gathers.append(reduced) or reduced  # type: ignore[func-returns-value]

    Reduced(Kind.WINDOW, clean.values, world(2, 0), [], gather=gather(clean)).check("step 1")
    assert gathers == []
    with pytest.raises(DenominatorError, match=r"^token_mean: rank 1: "):
        Reduced(Kind.WINDOW, flagged.values, world(2, 0), [], gather=gather(flagged)).check("step 1")
    assert gathers == [flagged]


def test_check_raises_the_same_message_on_every_rank_with_each_ranks_detail_as_a_note() -> None:
    messages = []
    for rank, reduced in enumerate(reduced_over(flagged_on({1}, 3, Problem.NO_LOSS))):
        with pytest.raises(DenominatorError, match=r"rank 1: `training_step` returned no loss") as raised:
            reduced.check("the accumulation window of step 7", f"what rank {rank} saw")
        messages.append(str(raised.value))
        assert raised.value.__notes__ == [f"On rank {rank}: what rank {rank} saw"]
    # the cause leads the first line, then where, then the fix
    assert messages[0].startswith(f"token_mean: rank 1: {Problem.NO_LOSS.what}, in the accumulation window of step 7.\n"
                                  f"  Fix: {Problem.NO_LOSS.fix}"), messages[0]
    assert messages == [messages[0]] * 3


def test_check_passes_when_no_rank_raised_and_raises_the_callers_own_lines() -> None:
    (reduced, *_) = reduced_over([Values(), Values()])
    reduced.check("step 1")
    with pytest.raises(DenominatorError, match=r"^token_mean: first, in step 1\.\n  Also: second$") as raised:
        reduced.check("step 1", more=["first", "second"])
    assert not hasattr(raised.value, "__notes__")  # no detail, no note


def test_raise_lines_returns_without_lines_and_raises_them_with_the_detail_as_a_note() -> None:
    raise_lines([], "step 1", "detail", 0)
    with pytest.raises(DenominatorError, match=r"^token_mean: one, in step 1") as raised:
        raise_lines(["one. Fix: two"], "step 1", "what I saw", 4)
    assert str(raised.value) == "token_mean: one, in step 1.\n  Fix: two"
    assert raised.value.__notes__ == ["On rank 4: what I saw"]


def test_ranks_at_different_kinds_are_out_of_step_and_the_message_says_which_are_where() -> None:
    kinds = [Kind.WINDOW, Kind.STREAM_END, Kind.WINDOW]
    reduced_all = reduced_over([Values()] * 3, kinds=kinds)
    messages = []
    for rank, reduced in enumerate(reduced_all):
        assert not reduced.in_step()
        with pytest.raises(DenominatorError, match="the ranks are out of step") as raised:
            reduced.check("the window of step 2", "its detail")
        messages.append(str(raised.value))
        assert raised.value.__notes__ == [f"On rank {rank}: at the window of step 2; its detail"]
    assert messages == [messages[0]] * 3
    assert (
        f"ranks 0, 2 at {Kind.WINDOW.value}; rank 1 at {Kind.STREAM_END.value}. The ranks' collectives no longer"
        f" match, so none of their results can be trusted. Fix: {Problem.OUT_OF_STEP.fix}"
    ) in messages[0]


def test_ranks_at_the_same_kind_but_different_collectives_are_out_of_step() -> None:
    for reduced in reduced_over([Values()] * 3, earlier=[1, 0, 1]):
        assert not reduced.in_step()
        expected = f"all ranks at {Kind.WINDOW.value}, but not as the same collective of their run"
        with pytest.raises(DenominatorError, match=re.escape(expected)):
            reduced.check("step 1")


def test_ranks_at_the_same_collective_are_in_step_and_out_of_step_hides_their_problems() -> None:
    assert all(reduced.in_step() for reduced in reduced_over([Values()] * 3, earlier=[2, 2, 2]))
    flagged = reduced_over(flagged_on({0}, 2), kinds=[Kind.WINDOW, Kind.BATCHES])[0]
    with pytest.raises(DenominatorError, match="out of step") as raised:
        flagged.check("step 1")
    assert Problem.BAD_LOSS.what not in str(raised.value)


def test_uneven_window_lengths_are_a_problem_of_window_records_only() -> None:
    lengths = [2.0, 2.0, 1.0]
    values = [Values({Slot.LENGTH: length, Slot.LENGTH_SQUARED: length * length}) for length in lengths]
    window_reduced = reduced_over(values)[0]
    assert not window_reduced.lengths_agree()
    assert window_reduced.lines() == [
        f"{Problem.UNEVEN.what} (total 5 micro-batches over 3 ranks). Fix: {Problem.UNEVEN.fix}"
    ]
    assert reduced_over(values, kind=Kind.STREAM_END)[0].lines() == []

    even = [Values({Slot.LENGTH: 2.0, Slot.LENGTH_SQUARED: 4.0})] * 3
    assert reduced_over(even)[0].lengths_agree()


def test_num_items_note_gives_the_shifted_labels_hint_only_when_the_difference_is_the_first_labels() -> None:
    def note(reported: float, counted: float, first: float) -> str:
        values = Values({Slot.REPORTED: reported, Slot.COUNTED: counted, Slot.FIRST_LABELS: first},
                        flags=frozenset({Problem.NUM_ITEMS_MISMATCH_DEFAULT}))
        (reduced,) = reduced_over([values])
        (only,) = reduced.lines()
        assert only.startswith(f"rank 0: {Problem.NUM_ITEMS_MISMATCH_DEFAULT.what}{reduced.num_items_note()}. Fix:")
        return reduced.num_items_note()

    assert note(10.0, 12.0, 2.0) == (
        " (over the micro-batches that disagree: 'num_items' sums to 10, the count to 12; the count is higher by"
        " exactly the 2 valid labels in the first position of a row: the labels are shifted inside the model; use"
        " `count_fn=token_mean.count_shifted_labels`)"
    )
    assert note(10.0, 12.0, 1.0) == " (over the micro-batches that disagree: 'num_items' sums to 10, the count to 12)"
    assert note(10.0, 12.0, 0.0) == " (over the micro-batches that disagree: 'num_items' sums to 10, the count to 12)"


def test_count_changed_line_gives_both_counts() -> None:
    values = Values({Slot.READ: 9.0, Slot.RECEIVED: 7.0}, flags=frozenset({Problem.COUNT_CHANGED}))
    (reduced,) = reduced_over([values])
    assert reduced.lines() == [
        f"rank 0: {Problem.COUNT_CHANGED.what} (over the micro-batches that changed: 9 valid items as the loader"
        f" yielded them, 7 in the batches `training_step` received). Fix: {Problem.COUNT_CHANGED.fix}"
    ]


# ---------------------------------------------------------------------------------------------------------------------
# the window on one rank
# ---------------------------------------------------------------------------------------------------------------------


def test_window_sums_count_and_mean_losses_times_counts_and_skips_empty_micro_batches_and_fillers() -> None:
    win = window()
    win.add(torch.tensor(3), scalar(0.5), filler=False)
    win.add(torch.tensor(0), scalar(NAN), filler=False)  # an empty micro-batch: its mean is 0/0
    win.add(torch.tensor(5), scalar(2.0).requires_grad_(), filler=False)
    win.add(win.channel.zero(), None, filler=True)
    assert win.where == "the accumulation window of optimizer step 1 (epoch 0, batches 0..3)"

    win.close()
    assert win.global_count().item() == 8.0
    reduced, local = win.read()

    assert reduced[Slot.COUNT] == 8.0
    assert reduced[Slot.LOSS_SUM] == 3 * 0.5 + 5 * 2.0
    assert (reduced[Slot.LENGTH], reduced[Slot.LENGTH_SQUARED]) == (4.0, 16.0)
    assert reduced[Slot.REAL] == 3.0
    assert (local, win.length, win.ended) == (8.0, 4, True)
    stats = win.stats(reduced, local, 8.0)
    assert stats == WindowStats(8.0, 8.0, None, 4, 11.5 / 8, False, "none", None)


def test_window_with_sum_reduction_adds_the_loss_sums_of_micro_batches_with_items() -> None:
    win = window(reduction="sum")
    win.add(torch.tensor(3), scalar(1.5), filler=False)
    win.add(torch.tensor(0), scalar(0.0), filler=False)
    win.add(torch.tensor(2), scalar(4.0), filler=False)
    reduced, _ = read(win)
    assert reduced[Slot.COUNT] == 5.0
    assert reduced[Slot.LOSS_SUM] == 5.5


def test_window_of_empty_micro_batches_has_no_count_and_no_loss() -> None:
    win = window()
    win.add(torch.tensor(0), scalar(NAN), filler=False)
    win.add(torch.tensor(0), scalar(NAN), filler=False)
    reduced, local = read(win)
    assert (reduced[Slot.COUNT], reduced[Slot.LOSS_SUM]) == (0.0, 0.0)
    stats = win.stats(reduced, local, 0.0)
    assert stats.skipped and stats.loss is None


def test_window_carries_aux_sums_and_what_the_mode_announces() -> None:
    win = window()
    win.add(torch.tensor(1), scalar(1.0), filler=False, aux=scalar(0.25))
    win.add(torch.tensor(1), scalar(1.0), filler=False, aux=scalar(0.5))
    reduced, _ = read(win, {Slot.NEXT_COUNT: 7.0, Slot.MORE: 1.0})
    assert reduced[Slot.AUX_SUM] == 0.75
    assert (reduced[Slot.NEXT_COUNT], reduced[Slot.MORE]) == (7.0, 1.0)


def test_nan_aux_loss_is_a_problem() -> None:
    win = window()
    win.add(torch.tensor(1), scalar(1.0), filler=False, aux=scalar(NAN))
    with pytest.raises(DenominatorError, match=r"rank 0: the 'aux_loss' of a micro-batch is NaN or infinite"):
        read(win)


def test_negative_count_is_a_problem_unless_counts_are_not_judged() -> None:
    def closed(**judges: bool) -> Window:
        win = window(**judges)
        win.add(torch.tensor(-2), scalar(1.0), filler=False)
        win.add(torch.tensor(3), scalar(1.0), filler=False)
        win.close()
        return win

    with pytest.raises(DenominatorError, match=r"rank 0: `count_fn` returned a negative count, in .*\n  Fix: counts"):
        closed().read()
    assert closed(judge_counts=False).read()[0][Slot.COUNT] == 3.0  # a bad count counts nothing


def test_nan_count_is_a_problem_unless_counts_are_not_judged() -> None:
    def closed(**judges: bool) -> Window:
        win = window(**judges)
        win.add(scalar(NAN), scalar(1.0), filler=False)
        win.add(torch.tensor(3), scalar(2.0), filler=False)
        win.close()
        return win

    with pytest.raises(DenominatorError, match=r"rank 0: `count_fn` returned a NaN or infinite count") as raised:
        closed().read()
    assert Problem.BAD_LOSS.what not in str(raised.value)  # the NaN count's loss is not the model's fault
    reduced, _ = closed(judge_counts=False).read()
    assert (reduced[Slot.COUNT], reduced[Slot.LOSS_SUM]) == (3.0, 6.0)


@pytest.mark.parametrize("bad", [NAN, math.inf])
def test_nonfinite_loss_of_a_micro_batch_with_items_is_a_problem(bad: float) -> None:
    win = window()
    win.add(torch.tensor(2), scalar(bad), filler=False)
    win.add(torch.tensor(3), scalar(1.0), filler=False)
    win.close()
    with pytest.raises(DenominatorError, match=r"rank 0: the loss of a micro-batch that the count says holds valid"):
        win.read()


def test_finite_loss_times_a_huge_count_overflowing_is_the_counts_problem() -> None:
    win = window()
    win.add(scalar(1e308), scalar(10.0), filler=False)
    with pytest.raises(DenominatorError, match=r"rank 0: the window's total count N is too small or too") as raised:
        read(win)
    assert Problem.BAD_LOSS.what not in str(raised.value)


def test_host_flag_raises_with_the_first_detail_as_the_note() -> None:
    win = window()
    win.add(torch.tensor(1), scalar(1.0), filler=False)
    win.flag(Problem.NO_LOSS, "first detail")
    win.flag(Problem.ALIASED, "second detail")
    assert win.flags == {Problem.NO_LOSS, Problem.ALIASED}
    with pytest.raises(DenominatorError, match=r"rank 0: `training_step` returned no loss") as raised:
        read(win)
    assert f"rank 0: {Problem.ALIASED.what}" in str(raised.value)
    assert raised.value.__notes__ == ["On rank 0: first detail"]


def test_num_items_mismatch_sums_both_sides_and_the_first_labels_over_the_micro_batches_that_differ() -> None:
    channel = RecordingChannel(World.single())
    win = window(channel)
    win.add(torch.tensor(12), scalar(1.0), filler=False)
    win.add(torch.tensor(5), scalar(1.0), filler=False)
    win.check_equal(Problem.NUM_ITEMS_MISMATCH_DEFAULT, 10.0, torch.tensor(12), torch.tensor(2))
    win.check_equal(Problem.NUM_ITEMS_MISMATCH_DEFAULT, 5.0, torch.tensor(5), torch.tensor(1))  # they agree
    win.close()
    assert channel.exchanges[0].record[Slot.DIFFERENT] == 1.0  # the window's record: one pair differs

    with pytest.raises(DenominatorError, match=r"rank 0: the default count \(`batch\['labels'\] != -100`\)") as raised:
        win.read()
    (diagnosis,) = channel.gathered  # the diagnosis: which problem, and by how much
    assert [diagnosis[slot].item() for slot in (Slot.REPORTED, Slot.COUNTED, Slot.FIRST_LABELS)] == [10.0, 12.0, 2.0]
    assert "'num_items' sums to 10, the count to 12; the count is higher by exactly the 2 valid labels" in str(
        raised.value
    )


def test_num_items_mismatch_with_count_fn_and_no_hint_leaves_first_empty() -> None:
    channel = RecordingChannel(World.single())
    win = window(channel)
    win.add(torch.tensor(4), scalar(1.0), filler=False)
    win.check_equal(Problem.NUM_ITEMS_MISMATCH_COUNT_FN, torch.tensor(3), torch.tensor(4))
    win.close()
    with pytest.raises(DenominatorError, match=r"rank 0: `count_fn\(batch\)` and the 'num_items' reported") as raised:
        win.read()
    assert channel.gathered[-1][Slot.FIRST_LABELS] == 0.0
    assert "'num_items' sums to 3, the count to 4)" in str(raised.value)


def test_count_changed_sums_the_count_read_and_the_count_received_over_the_micro_batches_that_changed() -> None:
    channel = RecordingChannel(World.single())
    win = window(channel)
    for read, received in ((4.0, 3), (2.0, 2), (6.0, 1)):
        win.add(torch.tensor(received), scalar(1.0), filler=False)
        win.check_equal(Problem.COUNT_CHANGED, read, torch.tensor(received))
    win.close()

    with pytest.raises(DenominatorError, match=r"10 valid items as the loader yielded them, 4 in the batches"):
        win.read()
    assert [channel.gathered[-1][slot].item() for slot in (Slot.READ, Slot.RECEIVED)] == [10.0, 4.0]


def test_checks_that_agree_raise_nothing() -> None:
    win = window()
    win.add(torch.tensor(4), scalar(1.0), filler=False)
    win.check_equal(Problem.COUNT_CHANGED, 4.0, torch.tensor(4))
    win.check_equal(Problem.NUM_ITEMS_MISMATCH_DEFAULT, 4.0, 4.0)
    assert read(win)[0][Slot.COUNT] == 4.0


# ---------------------------------------------------------------------------------------------------------------------
# WindowStats and windows over several fake ranks
# ---------------------------------------------------------------------------------------------------------------------


def test_window_stats_derive_imbalance_and_naive_weight_error_from_the_rank_counts() -> None:
    stats = WindowStats(8.0, 2.0, (2.0, 6.0), 1, 0.625, False, "lookahead")
    assert stats.world_size == 2
    assert stats.imbalance == 1.5
    assert stats.naive_weight_error == 0.5

    empty = WindowStats(0.0, 0.0, (0.0, 0.0, 0.0), 1, None, True, "deferred")
    assert (empty.world_size, empty.imbalance, empty.naive_weight_error) == (3, 0.0, 0.0)

    untracked = WindowStats(8.0, 2.0, None, 1, 0.625, False, "lookahead")
    assert (untracked.world_size, untracked.imbalance, untracked.naive_weight_error) == (None, None, None)


def test_three_ranks_windows_sum_to_the_hand_computed_stats() -> None:
    # each rank's micro-batches: (count, mean loss); rank 2 holds an empty micro-batch and a filler
    micro_batches = [[(3, 0.5), (1, 2.0)], [(6, 1.0), (2, 0.25)], [(0, NAN), None]]
    channels = [RecordingChannel(world(3, rank), rank_counts=True) for rank in range(3)]
    closings = []
    for channel, batches in zip(channels, micro_batches, strict=True):
        win = window(channel)
        for batch in batches:
            if batch is None:
                win.add(win.channel.zero(), None, filler=True)
            else:
                win.add(torch.tensor(batch[0]), scalar(batch[1]), filler=False)
        win.close()
        closings.append(win)
    all_reduce([channel.exchanges[0] for channel in channels])

    results = [closing.read() for closing in closings]

    global_count = 3 + 1 + 6 + 2
    loss = (3 * 0.5 + 1 * 2.0 + 6 * 1.0 + 2 * 0.25) / global_count
    for rank, ((reduced, local), local_count) in enumerate(zip(results, (4.0, 8.0, 0.0), strict=True)):
        stats = closings[rank].stats(reduced, local, reduced[Slot.COUNT])
        assert stats == WindowStats(12.0, local_count, (4.0, 8.0, 0.0), 2, loss, False, "none"), rank
        assert stats.world_size == 3
        assert stats.imbalance == 8.0 * 3 / 12.0
        assert stats.naive_weight_error == max(abs(3 * n / 12.0 - 1.0) for n in (4.0, 8.0, 0.0))
        assert reduced[Slot.REAL] == 5.0
        assert reduced.in_step() and reduced.lengths_agree()


def test_problem_of_one_fake_rank_raises_on_every_rank_with_only_its_own_note() -> None:
    channels, hub = fake_ranks(3)
    closings = []
    for rank, channel in enumerate(channels):
        win = window(channel)
        win.add(torch.tensor(2), scalar(1.0), filler=False)
        if rank == 1:
            win.flag(Problem.NO_LOSS, "training_step returned None")
        win.close()
        closings.append(win)
    all_reduce([channel.exchanges[0] for channel in channels])

    errors = in_threads([closing.read for closing in closings], hub, abort=False)
    assert all(isinstance(error, DenominatorError) for error in errors), errors
    assert all(str(error).startswith("token_mean: rank 1: `training_step` returned no loss") for error in errors)
    assert len({str(error) for error in errors}) == 1
    assert [getattr(error, "__notes__", []) for error in errors] == [[], ["On rank 1: training_step returned None"], []]


def test_fake_ranks_with_windows_of_different_lengths_raise_uneven() -> None:
    channels, hub = fake_ranks(3)
    closings = []
    for rank, channel in enumerate(channels):
        win = window(channel)
        for _ in range(1 if rank == 2 else 2):
            win.add(torch.tensor(1), scalar(1.0), filler=False)
        win.close()
        closings.append(win)
    all_reduce([channel.exchanges[0] for channel in channels])
    for error in in_threads([closing.read for closing in closings], hub, abort=False):
        assert isinstance(error, DenominatorError)
        assert re.search(r"different lengths \(total 5 micro-batches over 3 ranks\)", str(error))


# ---------------------------------------------------------------------------------------------------------------------
# the record carries sums; which rank had which problem is only gathered when a sum shows one
# ---------------------------------------------------------------------------------------------------------------------


def test_a_window_without_problems_runs_one_exchange_and_one_with_a_device_problem_a_gather() -> None:
    """The common path is one collective; a sum that shows a problem (here a NaN loss with items) makes every rank
    work out its own problems and gather them, and the error names the problem and the rank, not just the sum."""
    channel = RecordingChannel(World.single())
    win = window(channel)
    win.add(torch.tensor(3), scalar(0.5), filler=False)
    read(win)
    assert [exchange.kind for exchange in channel.exchanges] == [Kind.WINDOW] and channel.gathered == []

    channel = RecordingChannel(World.single())
    win = window(channel)
    win.add(torch.tensor(3), scalar(NAN), filler=False)
    win.close()
    assert channel.exchanges[0].record[ranks_slot(Problem.BAD_LOSS)] == 0.0  # not decided before the backward
    with pytest.raises(DenominatorError, match=r"rank 0: the loss of a micro-batch that the count says holds valid"):
        win.read()
    assert [exchange.kind for exchange in channel.exchanges] == [Kind.WINDOW]
    (gathered,) = channel.gathered
    assert gathered[ranks_slot(Problem.BAD_LOSS)] == 1.0 and gathered[ranks_slot(Kind.WINDOW)] == 1.0


def test_host_counts_sum_on_the_host_and_weight_the_losses_with_items() -> None:
    """Lookahead's counts are host floats: N's share needs no kernel, the loss sum one product of the losses that
    have items (an empty micro-batch's NaN mean, and a filler, add nothing)."""
    win = window(judge_counts=False)
    win.add(3.0, scalar(0.5), filler=False)
    win.add(0.0, scalar(NAN), filler=False)
    win.add(5.0, scalar(2.0), filler=False)
    win.add(0.0, None, filler=True)
    reduced, local = read(win)
    assert (reduced[Slot.COUNT], reduced[Slot.LOSS_SUM], local) == (8.0, 11.5, 8.0)


def test_host_floats_among_device_values_are_filled_in_on_the_device_not_copied_from_the_host() -> None:
    """A window takes each count, and each side of a check, as a host float or a device tensor. On CUDA a copy from
    pageable host memory (what ``torch.tensor(v).to(device)`` makes) waits for the device's queue, inside the window:
    where floats and tensors mix, each float goes in as a kernel argument (``aten.full``), and no host tensor is
    made (``aten.lift_fresh``) or copied (``aten._to_copy``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    counted, received, loss = scalar(4.0), scalar(2.0), scalar(1.0)

    def mixed(channel: Channel) -> Window:
        win = window(channel)
        win.add(counted, loss, filler=False)
        win.add(3.0, loss, filler=False)
        win.check_equal(Problem.COUNT_CHANGED, 4.0, counted)
        win.check_equal(Problem.COUNT_CHANGED, received, 3.0)
        win.close()
        return win

    channel = Channel(World.single())
    mixed(channel)  # the channel makes its index of the record's device slots once (a host tensor, copied once)
    with Ops() as ops:
        closing = mixed(channel)
    assert not {"lift_fresh", "_to_copy", "copy_"} & {name.split(".")[0] for name in ops.names}, ops.names
    assert ops.names.count("full.default") == 3  # the host count, and the host side of each check
    with pytest.raises(DenominatorError, match=r"2 valid items as the loader yielded them, 3 in the batches"):
        closing.read()
