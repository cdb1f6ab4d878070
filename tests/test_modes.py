"""Lookahead and Deferred driven in one process, the way a front end drives them, against a plain-torch reference.

No Lightning and no process group: a ``World.single()`` channel runs no collective. The loop below is what a front end
does per micro-batch (``epoch.micro_batch`` → forward → ``micro.loss_to_backprop`` → backward →
``micro.backward_done`` → ``epoch.end_window`` after the window's last). The reference (float64, relative 1e-12)
imports nothing from ``token_mean``: per window, the gradient of the sum of the per-token losses over the window's
batches divided by their valid-label count N.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from token_mean import DenominatorError, WindowStats
from token_mean._counts import count_valid_labels
from token_mean._epoch import UNKNOWN_END, Epoch, Passes
from token_mean._layout import World, unhooked_layout
from token_mean._modes import Mode, make_mode
from token_mean._problems import Problem
from token_mean._reader import Reader
from token_mean._settings import Settings
from token_mean._window import MicroBatch, StepOutput

FEATURES, CLASSES, ROWS, LENGTH = 3, 4, 2, 5
IGNORE_INDEX = -100
EXACT = 1e-12
SETTINGS = Settings(count_valid_labels, False, "mean", True)
MODES = ["lookahead", "deferred"]
MAX_MICRO_BATCHES = 64  # a loop that runs longer never ends its epoch

Batch = dict[str, Tensor]


def make_batch(seed: int, valid: int) -> Batch:
    """ROWS × LENGTH tokens of which ``valid`` (at random places) have a label."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, LENGTH, FEATURES, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (ROWS * LENGTH,), generator=generator)
    labels[valid:] = IGNORE_INDEX
    labels = labels[torch.randperm(ROWS * LENGTH, generator=generator)].reshape(ROWS, LENGTH)
    return {"x": x, "labels": labels}


def batches_with(valid: list[int]) -> list[Batch]:
    return [make_batch(seed, count) for seed, count in enumerate(valid)]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, CLASSES, dtype=torch.float64)


def mean_loss(model: nn.Module, batch: Batch) -> Tensor:
    logits = model(batch["x"]).reshape(-1, CLASSES)
    return F.cross_entropy(logits, batch["labels"].reshape(-1), ignore_index=IGNORE_INDEX)


# ---------------------------------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    grads: list[Tensor]
    count: float
    loss: float | None


def reference(model: nn.Module, window: list[Batch]) -> Expected:
    """(1/N) ∇ Σ per-token losses over the window's batches, N their valid labels."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    for batch in window:
        logits = model(batch["x"]).reshape(-1, CLASSES)
        labels = batch["labels"].reshape(-1)
        loss_sum = loss_sum + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels != IGNORE_INDEX).sum())
    if count == 0:
        return Expected([torch.zeros_like(parameter) for parameter in model.parameters()], 0.0, None)
    (loss_sum / count).backward()
    grads = [parameter.grad.clone() for parameter in model.parameters()]  # type: ignore[union-attr]
    return Expected(grads, float(count), loss_sum.item() / count)


def relative_error(grads: list[Tensor], expected: list[Tensor]) -> float:
    difference = sum(float((grad - want).square().sum()) for grad, want in zip(grads, expected, strict=True))
    scale = sum(float(want.square().sum()) for want in expected)
    return (difference / scale) ** 0.5


# ---------------------------------------------------------------------------------------------------------------------
# the front end
# ---------------------------------------------------------------------------------------------------------------------


class Loader:
    def __init__(self, batches: list[Batch | None]) -> None:
        self.items = [(batch,) for batch in batches]
        self.reads = 0

    def __call__(self) -> Any:
        if self.reads >= len(self.items):
            raise StopIteration
        self.reads += 1
        return self.items[self.reads - 1]


@dataclass
class Trained:
    """One window as the loop trained it."""

    positions: list[tuple[int, bool]]  # (position, filler)
    stats: WindowStats
    grads: list[Tensor]
    epoch_length: int  # where the pass ended after the window (a stream's end moves window by window)


@dataclass
class Loop:
    """A front end: one epoch of micro-batches through ``mode``, the optimizer step replaced by reading the gradient."""

    mode_name: str
    batches: list[Batch | None]
    accumulate: int
    sized: bool = True
    settings: Settings = SETTINGS
    num_items: Callable[[Batch], Any] | None = None  # what `training_step` reports as 'num_items'
    transfer: Callable[[Batch], Batch] = lambda batch: batch  # a hook between the loader and `training_step`
    model: nn.Module = field(default_factory=make_model)
    windows: list[Trained] = field(default_factory=list)
    hook: tuple[str, int] = ("", -1)  # the last hook called, and at which position
    k_at: Callable[[int], int] | None = None  # K set by a callback at each position

    def __post_init__(self) -> None:
        self.initial = copy.deepcopy(self.model)
        self.reader = Reader(Loader(self.batches))
        settings = replace(self.settings, mode=self.mode_name)
        self.mode: Mode = make_mode(settings, unhooked_layout(self.model, World.single()), rank_counts=False)
        self.passes = Passes(self.mode, self.settings.pad_uneven_ranks)

    def start(self) -> Epoch:
        length = len(self.batches) if self.sized else None
        self.passes.agree(length, length)
        return self.passes.begin(self.reader, 0)

    def run(self) -> list[Trained]:
        epoch = self.start()
        positions: list[tuple[int, bool]] = []
        for _ in range(MAX_MICRO_BATCHES):
            try:
                item = epoch.next_item()
            except StopIteration:
                return self.windows
            assert self.reader.current is not None
            position = self.reader.current.position
            self.hook = ("begin", position)
            micro = self.train(epoch, position, item[0])
            positions.append((position, micro.filler))
            self.hook = ("after_backward", position)
            if micro.last:
                stats = epoch.end_window()
                grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.model.parameters()]
                self.windows.append(Trained(positions, stats, grads, epoch.length))
                self.model.zero_grad(set_to_none=True)
                positions = []
        raise AssertionError(f"the epoch did not end after {MAX_MICRO_BATCHES} micro-batches")

    def train(self, epoch: Epoch, position: int, batch: Batch) -> MicroBatch:
        """micro-batch → forward → its loss to back-propagate → backward."""
        accumulate = self.accumulate if self.k_at is None else self.k_at(position)
        micro = epoch.micro_batch(position, accumulate, lambda: len(self.windows))
        batch = self.transfer(batch)
        loss = mean_loss(self.model, batch)
        num_items = None if self.num_items is None else self.num_items(batch)
        self.hook = ("after_forward", position)
        micro.loss_to_backprop(StepOutput(loss, None, num_items, loss), batch).backward()
        micro.backward_done()
        return micro


def assert_exact(loop: Loop, windows: list[list[Batch]]) -> None:
    """Every window the loop trained has the reference's gradient, count and loss."""
    assert len(loop.windows) == len(windows)
    for index, (trained, window) in enumerate(zip(loop.windows, windows, strict=True)):
        expected = reference(loop.initial, window)
        stats = trained.stats
        assert stats.global_count == expected.count, index
        assert stats.local_count == expected.count, index
        assert stats.mode == loop.mode_name
        if expected.loss is None:
            assert stats.skipped and stats.loss is None, index
            assert all(bool((grad == 0).all()) for grad in trained.grads), index
        else:
            assert not stats.skipped, index
            assert stats.loss == pytest.approx(expected.loss, rel=EXACT, abs=0.0), index
            assert relative_error(trained.grads, expected.grads) < EXACT, index


def chunks(batches: list[Batch], accumulate: int) -> list[list[Batch]]:
    return [batches[start : start + accumulate] for start in range(0, len(batches), accumulate)]


# ---------------------------------------------------------------------------------------------------------------------
# exactness
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_ragged_windows_with_an_empty_micro_batch_and_a_short_last_window_match_the_reference(mode: str) -> None:
    batches = batches_with([7, 1, 10, 3, 0, 9, 4, 6])  # the empty one's mean loss is NaN; the last window holds 2
    loop = Loop(mode, batches, accumulate=3)

    loop.run()

    assert_exact(loop, chunks(batches, 3))
    assert [trained.stats.window_length for trained in loop.windows] == [3, 3, 2]
    positions = [[position for position, _ in trained.positions] for trained in loop.windows]
    assert positions == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert all(trained.epoch_length == 8 for trained in loop.windows)  # a sized epoch: unchanged
    assert loop.mode.skipped_steps == 0


def test_plain_mean_of_micro_batch_means_misses_the_reference() -> None:
    """A control: the ragged data above is one where the naive 1/K Σ mean differs, so the tests can fail."""
    batches = batches_with([7, 1, 10])
    model = make_model()
    naive = sum((mean_loss(model, batch) for batch in batches), torch.zeros((), dtype=torch.float64)) / 3
    naive.backward()
    grads = [parameter.grad for parameter in model.parameters()]
    assert relative_error(grads, reference(make_model(), batches).grads) > 1e-3  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_window_without_valid_labels_is_skipped_with_zero_gradient_and_counted(mode: str) -> None:
    batches = batches_with([5, 2, 0, 0, 8, 3])
    loop = Loop(mode, batches, accumulate=2)

    with pytest.warns(UserWarning, match=r"no valid items on any rank \(N = 0\); its update was skipped"):
        loop.run()

    assert_exact(loop, chunks(batches, 2))
    assert [trained.stats.skipped for trained in loop.windows] == [False, True, False]
    assert loop.mode.skipped_steps == 1
    assert loop.mode.state_dict()["skipped_steps"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_none_batch_trains_at_zero_weight(mode: str) -> None:
    batches = batches_with([4, 6, 2, 5])
    loop = Loop(mode, [batches[0], None, batches[1], batches[2], batches[3], None], accumulate=3)

    loop.run()

    assert_exact(loop, [batches[:2], batches[2:]])
    assert [trained.positions for trained in loop.windows] == [
        [(0, False), (1, True), (2, False)], [(3, False), (4, False), (5, True)]
    ]
    assert [trained.stats.window_length for trained in loop.windows] == [3, 3]


@pytest.mark.parametrize("mode", MODES)
def test_stream_windows_are_padded_to_k_with_fillers_and_the_epoch_ends_with_the_stream(mode: str) -> None:
    batches = batches_with([6, 2, 9, 4, 7])
    loop = Loop(mode, batches, accumulate=3, sized=False)

    loop.run()

    assert_exact(loop, chunks(batches, 3))
    assert [trained.positions for trained in loop.windows] == [
        [(0, False), (1, False), (2, False)], [(3, False), (4, False), (5, True)]
    ]
    assert [trained.epoch_length for trained in loop.windows] == [UNKNOWN_END, 6]  # it goes on, then ends


@pytest.mark.parametrize(
    "mode",
    ["lookahead", "deferred"],
)
@pytest.mark.filterwarnings("ignore:token_mean. an accumulation window had no valid items")
def test_stream_that_ends_in_its_first_window_ends_the_epoch_there(mode: str) -> None:
    batches = batches_with([6, 2])
    loop = Loop(mode, batches, accumulate=3, sized=False)

    loop.run()

    assert_exact(loop, [batches])
    assert loop.windows[0].positions == [(0, False), (1, False), (2, True)]
    assert loop.windows[0].epoch_length == 3


@pytest.mark.parametrize("mode", MODES)
def test_stream_without_any_batch_trains_nothing(mode: str) -> None:
    loop = Loop(mode, [], accumulate=2, sized=False)
    assert loop.run() == []


# ---------------------------------------------------------------------------------------------------------------------
# num_items
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_num_items_that_agrees_with_the_count_is_exact(mode: str) -> None:
    batches = batches_with([7, 1, 10, 3])
    loop = Loop(mode, batches, accumulate=2, num_items=lambda batch: int((batch["labels"] != IGNORE_INDEX).sum()))
    loop.run()
    assert_exact(loop, chunks(batches, 2))


def test_deferred_takes_num_items_as_the_count() -> None:
    batches = batches_with([7, 1, 10, 3])
    loop = Loop("deferred", batches, accumulate=2, num_items=lambda batch: 100)
    loop.run()
    assert [trained.stats.global_count for trained in loop.windows] == [200.0, 200.0]


def test_lookahead_checks_num_items_against_the_default_count_with_the_shifted_labels_hint() -> None:
    def shifted(batch: Batch) -> Tensor:
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    batches = batches_with([7, 8, 10, 3])
    loop = Loop("lookahead", batches, accumulate=2, num_items=shifted)
    with pytest.raises(DenominatorError, match=r"the default count \(`batch\['labels'\] != -100`\) and the 'num_items'"
                       ) as raised:
        loop.run()
    assert "use `count_fn=token_mean.count_shifted_labels`" in str(raised.value)
    assert loop.hook == ("after_backward", 1)
    assert loop.windows == []


def test_deferred_checks_num_items_against_a_given_count_fn() -> None:
    settings = Settings(count_valid_labels, True, "mean", True)
    loop = Loop("deferred", batches_with([7, 8]), accumulate=2, settings=settings, num_items=lambda batch: 3)
    with pytest.raises(DenominatorError, match=r"`count_fn\(batch\)` and the 'num_items' reported with the loss"):
        loop.run()
    assert loop.hook == ("after_backward", 1)


# ---------------------------------------------------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------------------------------------------------


def count_failing_on_marked(batch: Batch) -> Tensor:
    if "bad" in batch:
        raise ValueError("no labels here")
    return count_valid_labels(batch)


def test_lookahead_raises_a_failing_count_fn_before_the_window_that_holds_the_batch() -> None:
    batches = batches_with([4, 5, 6, 7])
    batches[2] = {**batches[2], "bad": torch.ones(1)}
    settings = Settings(count_failing_on_marked, True, "mean", True)
    loop = Loop("lookahead", batches, accumulate=2, settings=settings)

    with pytest.raises(DenominatorError, match=r"rank 0: `count_fn` failed or returned something that is") as raised:
        loop.run()

    # the counts of window 2 travel in window 1's record: raised after its last backward, before its update
    assert loop.hook == ("after_backward", 1)
    assert raised.value.__notes__ == [
        "On rank 0: the batch at position 2 (read ahead): `count_fn` raised ValueError: no labels here"
    ]


def test_lookahead_raises_a_failing_count_fn_of_the_first_window_before_its_first_forward() -> None:
    batches = batches_with([4, 5])
    batches[1] = {**batches[1], "bad": torch.ones(1)}
    loop = Loop("lookahead", batches, accumulate=2, settings=Settings(count_failing_on_marked, True, "mean", True))
    with pytest.raises(DenominatorError, match=r"`count_fn` failed or returned something that is not a number"):
        loop.run()
    assert loop.hook == ("begin", 0)


def test_deferred_raises_a_failing_count_fn_at_the_end_of_the_window_that_holds_the_batch() -> None:
    batches = batches_with([4, 5, 6, 7])
    batches[2] = {**batches[2], "bad": torch.ones(1)}
    loop = Loop("deferred", batches, accumulate=2, settings=Settings(count_failing_on_marked, True, "mean", True))

    with pytest.raises(DenominatorError, match=r"rank 0: `count_fn` failed or returned something that is") as raised:
        loop.run()

    assert loop.hook == ("after_backward", 3)
    assert len(loop.windows) == 1
    assert raised.value.__notes__ == [
        "On rank 0: `count_fn` raised ValueError on the batch `training_step` received: no labels here"
    ]


def tiny_on_marked(batch: Batch) -> Tensor | float:
    """A sample weight so small that a window of two sums to an N whose 1/N overflows float64."""
    return 1e-320 if "tiny" in batch else count_valid_labels(batch)


def tiny_windows(*positions: int) -> list[Batch]:
    batches = batches_with([4, 5, 6, 7])
    for position in positions:
        batches[position] = {**batches[position], "tiny": torch.ones(1)}
    return batches


TINY = Settings(tiny_on_marked, True, "mean", True)
TOO_SMALL = r"N = 2e-320: the window's total count N is too small or too large for float64 to normalize by"


def test_lookahead_raises_an_n_that_cannot_normalize_the_first_window_naming_it_before_its_first_forward() -> None:
    loop = Loop("lookahead", tiny_windows(0, 1), accumulate=2, settings=TINY)
    with pytest.raises(DenominatorError, match=TOO_SMALL + r".*, in the accumulation window of optimizer step 0"
                       r" \(epoch 0, batches 0\.\.1\)\."):
        loop.run()
    assert loop.hook == ("begin", 0)


def test_lookahead_raises_an_n_that_cannot_normalize_the_next_window_naming_that_window() -> None:
    """The next window's N arrives with this window's record: raised before this window's update, naming the window
    it counts (batches 2..3), not the one that carried it."""
    loop = Loop("lookahead", tiny_windows(2, 3), accumulate=2, settings=TINY)
    with pytest.raises(DenominatorError, match=TOO_SMALL + r".*, in the accumulation window after that of optimizer"
                       r" step 0 \(epoch 0, batches 2\.\.3\)\."):
        loop.run()
    assert loop.hook == ("after_backward", 1)


def test_deferred_raises_an_n_that_cannot_normalize_at_the_end_of_its_window() -> None:
    loop = Loop("deferred", tiny_windows(2, 3), accumulate=2, settings=TINY)
    with pytest.raises(DenominatorError, match=TOO_SMALL + r".*, in the accumulation window of optimizer step 1"
                       r" \(epoch 0, batches 2\.\.3\)\."):
        loop.run()
    assert (loop.hook, len(loop.windows)) == (("after_backward", 3), 1)


@pytest.mark.parametrize("mode", MODES)
def test_nan_loss_of_a_micro_batch_with_items_raises_at_the_windows_end(mode: str) -> None:
    batches = batches_with([4, 5, 6, 7])
    batches[3]["x"][0, 0, 0] = float("nan")
    loop = Loop(mode, batches, accumulate=2)

    with pytest.raises(DenominatorError, match=r"rank 0: the loss of a micro-batch that the count says holds valid"):
        loop.run()

    assert loop.hook == ("after_backward", 3)
    assert len(loop.windows) == 1


def fewer_labels(batch: Batch) -> Batch:
    """A transfer hook that drops every valid label of the first row."""
    labels = batch["labels"].clone()
    labels[0] = IGNORE_INDEX
    return {**batch, "labels": labels}


def test_lookahead_refuses_a_batch_whose_labels_changed_after_the_loader() -> None:
    batches = batches_with([7, 8, 10, 3])
    loop = Loop("lookahead", batches, accumulate=2, transfer=fewer_labels)

    with pytest.raises(DenominatorError, match=r"rank 0: the batch `training_step` received holds a different count"
                       ) as raised:
        loop.run()

    message = str(raised.value)
    assert "`on_after_batch_transfer`" in message and "use `mode='deferred'`" in message
    assert "valid items as the loader yielded them" in message
    assert loop.hook == ("after_backward", 1)


def test_deferred_counts_the_batch_training_step_received() -> None:
    batches = batches_with([7, 8, 10, 3])
    loop = Loop("deferred", batches, accumulate=2, transfer=fewer_labels)
    loop.run()
    assert_exact(loop, chunks([fewer_labels(batch) for batch in batches], 2))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("again", [0, 2], ids=["trained-twice", "skipped"])
def test_position_trained_twice_or_skipped_is_refused(mode: str, again: int) -> None:
    loop = Loop(mode, batches_with([4, 5, 6]), accumulate=3)
    epoch = loop.start()
    loop.train(epoch, 0, epoch.next_item()[0])

    with pytest.raises(RuntimeError, match="a batch was trained twice or skipped"):
        epoch.micro_batch(again, 3, lambda: 0)


def test_deferred_refuses_an_aux_loss() -> None:
    loop = Loop("deferred", batches_with([4, 5]), accumulate=2)
    epoch = loop.start()
    batch = epoch.next_item()[0]
    micro = epoch.micro_batch(0, 2, lambda: 0)
    loss = mean_loss(loop.model, batch)
    backprop = micro.loss_to_backprop(StepOutput(loss, loss * 0.1, None, loss), batch)
    assert Problem.AUX_LOSS_DEFERRED in micro.window.flags  # raised on every rank at the window's end
    assert backprop.grad_fn is not None  # the backward still runs (without the aux term), so no rank is left waiting


# ---------------------------------------------------------------------------------------------------------------------
# K changed by a callback (`trainer.accumulate_grad_batches = ...`): Lightning steps when (position + 1) % K == 0
# with the K in force
# ---------------------------------------------------------------------------------------------------------------------

K_CHANGES = [  # (K before, position of the change, K after, the windows Lightning steps or None: refused)
    pytest.param(2, 4, 4, {"lookahead": [[0, 1], [2, 3], [4, 5, 6, 7]], "deferred": [[0, 1], [2, 3], [4, 5, 6, 7]]},
                 id="at-a-window-start"),
    pytest.param(4, 3, 2, {"lookahead": None, "deferred": None}, id="inside-same-end"),
    pytest.param(2, 1, 4, {"lookahead": None, "deferred": None}, id="inside-later-end"),
    pytest.param(3, 2, 2, {"lookahead": None, "deferred": None}, id="inside-zeroing"),
    pytest.param(2, 4, 3, {"lookahead": None, "deferred": None}, id="at-a-window-start-without-zeroing"),
]


@pytest.mark.parametrize(("before", "at", "after", "windows"), K_CHANGES)
@pytest.mark.parametrize("mode", MODES)
def test_k_changed_by_a_callback_is_exact_for_the_window_lightning_steps_or_refused(
    mode: str, before: int, at: int, after: int, windows: dict[str, list[list[int]] | None]
) -> None:
    batches = batches_with([7, 1, 10, 3, 2, 9, 4, 6])
    loop = Loop(mode, batches, accumulate=before, k_at=lambda position: before if position < at else after)
    expected = windows[mode]
    if expected is None:
        with pytest.raises(ValueError, match=rf"`trainer.accumulate_grad_batches` changed from {before} to {after} at"
                           rf" batch {at}, "):
            loop.run()
        return
    loop.run()
    assert_exact(loop, [[batches[i] for i in window] for window in expected])
    assert [[position for position, _ in trained.positions] for trained in loop.windows] == expected


# ---------------------------------------------------------------------------------------------------------------------
# the micro-batch's filler mark
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_filler_mark_lasts_from_the_micro_batch_to_its_backward(mode: str) -> None:
    """One mark, on the micro-batch: `in_filler_batch()` (what metrics read) is True from a filler's micro-batch to
    its backward and False after it and for real batches, in every front end alike."""
    from token_mean import in_filler_batch

    batches = batches_with([4, 6])
    loop = Loop(mode, [batches[0], None, batches[1]], accumulate=3)
    epoch = loop.start()
    seen = []
    for position in range(3):
        batch = epoch.next_item()[0]
        micro = epoch.micro_batch(position, 3, lambda: 0)
        during = in_filler_batch()
        loss = mean_loss(loop.model, batch)
        micro.loss_to_backprop(StepOutput(loss, None, None, loss), batch).backward()
        micro.backward_done()
        seen.append((micro.filler, during, micro.is_filler, in_filler_batch()))
    assert seen == [(False, False, False, False), (True, True, False, False), (False, False, False, False)]
    assert epoch.end_window().window_length == 3
