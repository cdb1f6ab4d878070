"""``TokenMeanAccumulator`` under Lightning Fabric: every rank takes part in every window, and a problem on one rank
is raised on every rank before the update.

Empty micro-batches, an empty rank, an empty window and ranks without batches are exact; a bad count, a NaN loss or a
``count_fn`` that raises on rank 1 only, and ranks out of step, raise the same error on every rank. Exact results are
compared with the float64 plain-torch reference at 1e-12 beside LitGPT's loop (``fabric.backward(loss / K)``), the
control that must miss; errors are read from every forked rank (``_fabric_loop.every_rank_raises``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _fabric import (
    fabric_for,
    full_state,
    launched,
    plain_loop,
    setup,
    shifted_count,
    shifted_loss,
)
from _fabric_loop import (
    FABRICS,
    GLOO_TIMEOUT,
    MISSES,
    POISON,
    K,
    Step,
    ddp,
    every_rank_raises,
    guarded,
    loss_only,
    one_message,
    poisoned,
    ragged,
    reference,
    train,
)
from _harness import (
    EXACT,
    IGNORE_INDEX,
    MODES,
    Batch,
    empty_like,
    initial_state,
    relative_error,
)
from _ranks import notes_of
from lightning.fabric import Fabric
from torch import Tensor

from token_mean import (
    DenominatorError,
    TokenMeanLoss,
    count_shifted_labels,
)
from token_mean.fabric import TokenMeanAccumulator

# ---------------------------------------------------------------------------------------------------------------
# 1. empty micro-batches, an empty rank, an empty window, ranks without batches
# ---------------------------------------------------------------------------------------------------------------


def with_empties(case: str) -> list[list[Batch]]:
    """6 batches per rank (3 windows of K = 2) and the empty ones of ``case``:

    - ``micro-batches``: rank 0's batch 0 and rank 1's batch 3 hold no target;
    - ``rank``: every label of rank 1 is -100 for all of window 1 (batches 2, 3), and rank 0's batch 0 is empty;
    - ``window``: window 1 is empty on every rank (N = 0: no update, the optimizer's momentum untouched).
    """
    data = ragged(2, 6, seed=41)
    empty = {"micro-batches": [(0, 0), (1, 3)], "rank": [(0, 0), (1, 2), (1, 3)],
             "window": [(0, 2), (0, 3), (1, 2), (1, 3)]}[case]
    for rank, index in empty:
        data[rank][index] = empty_like(data[rank][index])
    return data


EMPTY_CASES = ["micro-batches", "rank", "window"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("case", EMPTY_CASES)
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_empty_micro_batches_ranks_and_windows_are_exact(layout: str, case: str, mode: str) -> None:
    """Exact at 1e-12 in both modes; the window with N = 0 everywhere is skipped (no step) and counted.

    Control: LitGPT's loop misses in every case: a mean of means weighs an empty micro-batch (loss 0) and an empty
    rank like full ones, and steps the optimizer (momentum) on an empty window.
    """
    data = with_empties(case)
    expected, counts = reference(data)
    if mode == "plain":
        params = launched(FABRICS[layout](), plain_loop, data, K)
        assert relative_error(params, expected) > MISSES, "LitGPT's loop matched the token mean: the test cannot fail"
        return
    result = launched(FABRICS[layout](), train, data, mode)
    assert relative_error(result["params"], expected) < EXACT, f"{relative_error(result['params'], expected):.3e}"
    assert [window["global_count"] for window in result["windows"]] == counts
    assert [window["skipped"] for window in result["windows"]] == [count == 0 for count in counts]
    assert result["skipped"] == (case == "window")
    if case == "rank":  # rank 1 counted nothing in window 1: N is rank 0's own count
        assert result["windows"][1]["local_count"] == counts[1] > 0


def nan_mean(model: Any, batch: Batch) -> dict[str, Any]:
    """``F.cross_entropy``'s own mean: 0/0 = NaN for a micro-batch without a target."""
    logits = model(batch["x"])[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX)
    return {"loss": loss}


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_an_empty_micro_batch_whose_mean_is_nan(mode: str) -> None:
    """An empty micro-batch's mean loss is NaN (0/0, ``F.cross_entropy``'s default): it adds nothing, and the run is
    exact. Control: LitGPT's loop on the same losses sees the NaN losses (their mean of means is NaN) and misses."""
    data = with_empties("rank")
    expected, _ = reference(data)
    result = launched(ddp(), train, data, mode, step=nan_mean)
    assert relative_error(result["params"], expected) < EXACT
    params, saw_nan = launched(ddp(), _plain_nan_mean, data)
    assert saw_nan and relative_error(params, expected) > MISSES


def _plain_nan_mean(fabric: Fabric, data: list[list[Batch]]) -> tuple[dict[str, Tensor], bool]:
    model, optimizer = setup(fabric)
    batches = data[fabric.global_rank]
    saw_nan = False
    for index, batch in enumerate(batches):
        accumulating = (index + 1) % K != 0 and index + 1 != len(batches)
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = nan_mean(model, batch)["loss"]
            saw_nan = saw_nan or bool(loss.isnan())
            fabric.backward(loss / K)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
    every_rank = [False] * fabric.world_size
    torch.distributed.all_gather_object(every_rank, saw_nan)
    return full_state(model), any(every_rank)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_fillers_are_flagged_and_left_out_of_a_training_metric(mode: str) -> None:
    """Rank 1 has 3 batches to rank 0's 7: it yields 4 zero-weight fillers, flagged by ``is_filler``, and a
    ``TokenMeanLoss`` updated on every batch of the loop counts only real ones (it sees ``in_filler_batch``).

    Control: the exactness itself (``test_fabric.test_uneven_ranks_are_padded_with_fillers``); here the count of a
    metric that did not skip fillers would be rank 1's last batch counted 4 more times.
    """
    data = ragged(2, 7, seed=43)
    data[1] = data[1][:3]
    fillers, counted = launched(ddp(), _metric_in_the_loop, data, mode)
    assert fillers == [[False] * 7, [False] * 3 + [True] * 4]
    assert counted == float(sum(shifted_count(batch) for rank in data for batch in rank))


def _metric_in_the_loop(fabric: Fabric, data: list[list[Batch]], mode: str) -> tuple[list[list[bool]], float]:
    model, optimizer = setup(fabric)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=3, mode=mode, count_fn=count_shifted_labels)
    metric = TokenMeanLoss().to(fabric.device)
    fillers = []
    for batch in accumulator.batches(data[fabric.global_rank]):
        fillers.append(accumulator.is_filler_batch)
        with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
            loss = shifted_loss(model, batch)
            metric.update(loss.detach(), shifted_count(batch))
            accumulator.backward(loss)
        if not accumulator.accumulating:
            accumulator.finish()
            optimizer.step()
            optimizer.zero_grad()
    every_rank = [None] * fabric.world_size
    torch.distributed.all_gather_object(every_rank, fillers)
    with metric.sync_context():
        count = float(metric.count)
    return every_rank, count  # type: ignore[return-value]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("lengths", "pad", "match"), [
    ((4, 0), True, r"between 0 and 4 batches this epoch \(this rank: {local}\)\. A rank without any batch"),
    ((4, 3), False, r"between 3 and 4 batches this epoch \(this rank: {local}\)\. With `pad_uneven_ranks=False`"),
], ids=["a-rank-without-batches", "uneven-without-padding"])
def test_ranks_that_cannot_be_padded_are_refused_on_every_rank(
    tmp_path: Path, lengths: tuple[int, int], pad: bool, match: str
) -> None:
    """A rank with no batch (nothing to repeat) and uneven ranks with ``pad_uneven_ranks=False``: a ValueError on
    every rank when the pass starts, before any forward. Control: ``lengths`` (4, 4) trains (the other tests)."""
    data = [rank[:length] for rank, length in zip(ragged(2, 4, seed=44), lengths, strict=True)]
    errors = every_rank_raises(ddp(), tmp_path, train, data, "lookahead", pad_uneven_ranks=pad)
    for rank, message in enumerate(errors):
        assert message.startswith("ValueError: token_mean: the ranks' training loaders"), message
        assert re.search(match.format(local=lengths[rank]), message), message


@pytest.mark.distributed
def test_a_length_on_some_ranks_only_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 loops over a list, rank 1 over a generator (no length): a ValueError on every rank when the pass
    starts, before any forward."""
    data: list[Any] = ragged(2, 4, seed=44)
    data[1] = (batch for batch in data[1])
    errors = every_rank_raises(ddp(), tmp_path, train, data, "lookahead")
    assert one_message(errors) == (
        "ValueError: token_mean: the training loaders have a length on some ranks and none on others (an"
        " IterableDataset on some ranks only?); give every rank the same kind of loader."
    )


# ---------------------------------------------------------------------------------------------------------------
# 2. a bad count, a NaN loss, a count_fn that raises, on rank 1 only
# ---------------------------------------------------------------------------------------------------------------


def count_or_string(batch: Batch) -> Any:
    return "12" if POISON in batch else count_shifted_labels(batch)


def count_or_negative(batch: Batch) -> Any:
    return -3 if POISON in batch else count_shifted_labels(batch)


def count_or_raise(batch: Batch) -> Any:
    if POISON in batch:
        raise KeyError("no count for this batch")
    return count_shifted_labels(batch)


def nan_loss_if_poisoned(model: Any, batch: Batch) -> dict[str, Any]:
    loss = shifted_loss(model, batch)
    return {"loss": loss * float("nan") if POISON in batch else loss}


PROBLEMS: dict[str, tuple[Callable[[Batch], Any], Step, str, str]] = {
    # name: (count_fn, step, the line of the message, rank 1's own note ("" where the device decided))
    "count-is-a-string": (count_or_string, loss_only, "rank 1: `count_fn` failed or returned something that is not"
                          " a number", "On rank 1: `count_fn` gave str '12', not an int"),
    "count-is-negative": (count_or_negative, loss_only, "rank 1: `count_fn` returned a negative count", ""),
    "count-fn-raises": (count_or_raise, loss_only, "rank 1: `count_fn` failed", "On rank 1: `count_fn` raised"
                        " KeyError"),
    "nan-loss": (count_shifted_labels, nan_loss_if_poisoned, "rank 1: the loss of a micro-batch that the count says"
                 " holds valid items is NaN or infinite", ""),
}


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [0, 1], ids=["first-window", "second-window"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_a_problem_on_one_rank_raises_on_every_rank_before_the_update(
    tmp_path: Path, problem: str, mode: str, window: int
) -> None:
    """The same DenominatorError on both ranks, naming rank 1, before the optimizer step of the window it is in.

    Deferred mode counts after the forward: it raises in ``finish()`` of that window. Lookahead reads a window's
    counts before its first forward: a count problem raises before the window trains at all (the pass's first
    window: in the iterator, before any forward; a later one: in ``finish()`` of the window before it, whose record
    carries the next window's counts); a NaN loss is only known after the forward: ``finish()`` of its window.
    Every rank's parameters at the error are those after the windows before (the initial ones, or the reference's
    first window). Control: :func:`test_the_unpoisoned_loop_runs` (the same loop and counts without the mark).
    """
    count_fn, step, line, note = PROBLEMS[problem]
    counted_ahead = mode == "lookahead" and problem != "nan-loss"
    where = "batches" if counted_ahead and window == 0 else "finish"
    steps = 0 if counted_ahead else window
    raised_in = 0 if counted_ahead else window
    data = poisoned(window)
    message = one_message(every_rank_raises(ddp(), tmp_path, guarded, tmp_path, data, mode, count_fn, step))
    assert message.startswith("DenominatorError: token_mean: "), message
    assert (f", in the accumulation window of optimizer step {raised_in} (pass 1, batches {raised_in * K}.."
            in message.splitlines()[0]), message  # the cause, then where, on the first line
    assert line in message, message
    notes = notes_of(tmp_path)
    if counted_ahead and note:  # lookahead counted the batch when it read it ahead, and says which one
        note = note.replace("On rank 1: ", f"On rank 1: the batch at position {window * K} (read ahead): ")
    assert note in notes[1], notes
    # the parameters after the windows before: the initial ones, or the reference's first window
    expected = reference([rank[: steps * K] for rank in data])[0] if steps else initial_state()
    for rank in range(2):
        state = torch.load(tmp_path / f"state{rank}.pt", weights_only=True)
        assert (state["where"], state["steps"]) == (where, steps), (rank, state["where"], state["steps"])
        assert relative_error(state["params"], expected) < EXACT


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_the_unpoisoned_loop_runs(problem: str, mode: str) -> None:
    """The control of the test above: the same count_fn and loss on the same batches without the mark train exactly,
    so the error there comes from the marked batch alone."""
    count_fn, step, _, _ = PROBLEMS[problem]
    data = ragged(2, 6, seed=45)
    result = launched(ddp(), train, data, mode, step=step, count_fn=count_fn)
    assert relative_error(result["params"], reference(data)[0]) < EXACT


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_a_nan_loss_raises_where_the_plain_loop_steps_on_it(tmp_path: Path, mode: str) -> None:
    """A NaN loss on rank 1 in window 1: the same DenominatorError on both ranks, and both ranks' parameters are
    still the initial ones. Control: LitGPT's loop on the same batches steps on the NaN gradient, and every parameter
    is NaN after it."""
    data = poisoned(0)
    count_fn, step, line, _ = PROBLEMS["nan-loss"]
    message = one_message(every_rank_raises(ddp(), tmp_path, guarded, tmp_path, data, mode, count_fn, step))
    assert line in message, message
    for rank in range(2):
        state = torch.load(tmp_path / f"state{rank}.pt", weights_only=True)
        assert relative_error(state["params"], initial_state()) == 0.0
    params = launched(ddp(), _plain_poisoned, data)
    assert all(torch.isnan(value).all() for value in params.values())


def _plain_poisoned(fabric: Fabric, data: list[list[Batch]]) -> dict[str, Tensor]:
    model, optimizer = setup(fabric)
    for index, batch in enumerate(data[fabric.global_rank]):
        accumulating = (index + 1) % K != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(nan_loss_if_poisoned(model, batch)["loss"] / K)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
    return full_state(model)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_a_problem_on_one_data_parallel_rank_raises_on_every_rank_of_the_mesh(tmp_path: Path, mode: str) -> None:
    """FSDP2 × TP on 2 × 2: data-parallel rank 1 (processes 2 and 3, which read the same batches) returns a negative
    count; all four processes raise the same error naming data-parallel rank 1. Control: the unmarked run of
    ``test_fabric.test_matches_the_unpartitioned_reference[fsdp2xtp-*]``."""
    data = poisoned(0)
    message = one_message(every_rank_raises(FABRICS["fsdp2xtp"](), tmp_path, guarded, tmp_path, data, mode,
                                            count_or_negative, loss_only))
    assert message.startswith("DenominatorError: token_mean: "), message
    assert "rank 1: `count_fn` returned a negative count" in message, message


@pytest.mark.parametrize("mode", ["lookahead"])
def test_a_first_window_count_error_names_the_windows_batches(mode: str) -> None:
    """One device: the first window's count fails before its first forward; the message should name its batches."""
    data = poisoned(0)[1]
    fabric = fabric_for("single")
    model, _ = setup(fabric)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=K, mode=mode, count_fn=count_or_string)
    with pytest.raises(DenominatorError, match=r"optimizer step 0 \(pass 1, batches 0\.\.1\)"):
        next(iter(accumulator.batches(data)))


# ---------------------------------------------------------------------------------------------------------------
# 3. ranks out of step: rank 0 stops a pass early and starts the next one while rank 1 goes on
# ---------------------------------------------------------------------------------------------------------------


def leaves_early(fabric: Fabric, data: list[list[Batch]], mode: str, stop_after: int) -> None:
    """Two passes; in the first, rank 0 breaks out of the loop after batch ``stop_after`` (and its window's step when
    that is the window's last) and starts the second pass, while rank 1 trains its whole first pass."""
    model, optimizer = setup(fabric)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=K, mode=mode, count_fn=count_shifted_labels)
    for epoch in range(2):
        for index, batch in enumerate(accumulator.batches(data[fabric.global_rank])):
            with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
                accumulator.backward(shifted_loss(model, batch))
            if not accumulator.accumulating:
                accumulator.finish()
                optimizer.step()
                optimizer.zero_grad()
            if fabric.global_rank == 0 and epoch == 0 and index == stop_after:
                break


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stop_after", [3, 4], ids=["at-a-window-boundary", "mid-window"])
def test_a_rank_that_leaves_a_pass_early(tmp_path: Path, mode: str, stop_after: int) -> None:
    """Rank 0 leaves after window 2 (batch 3), or inside window 3 (after batch 4's backward), and starts its next pass
    with the agreement on the pass's length, while rank 1 reaches the end of window 2 or 3: both read each other's
    record, rank 0 joins rank 1's gradient all-reduce with zeros, and every rank raises the same out-of-step error
    in well under the 15 s process-group timeout.

    Not covered (it can only time out): rank 0 leaving after the *first* window. DDP's reducer rebuilds its buckets
    in the first synchronized forward after the first reduced backward (``_rebuild_buckets``, a broadcast of the
    bucket order), and rank 1's broadcast meets rank 0's all-reduce: both wait for the timeout. Rank 0 running one
    pass fewer and returning makes rank 1 fail at once on gloo's closed connection (a RuntimeError of gloo's).
    Control: the same loop without the break trains (``test_fabric``).
    """
    data = ragged(2, 6, seed=46)
    started = time.monotonic()
    message = one_message(every_rank_raises(ddp(), tmp_path, leaves_early, data, mode, stop_after))
    elapsed = time.monotonic() - started
    assert elapsed < GLOO_TIMEOUT.total_seconds() / 2, f"{elapsed:.1f} s: a rank waited for the timeout"
    assert message.startswith("DenominatorError: token_mean: the ranks are out of step"), message
    assert "rank 0 at the agreement on the length of an epoch (or of a Fabric pass)" in message, message
    assert "rank 1 at the end of an accumulation window" in message, message
