"""``accumulator.windows(...)``, torchtitan's loop shape, on the very pass of ``accumulator.batches(...)``.

``for window in accumulator.windows(loader): for batch in window: ...; window.finish()`` must train exactly what
LitGPT's shape trains (the float64 reference at 1e-12, and the batches() loop's parameters bit for bit), read the
loader no further, and make misuse an error at once, as the batches() loop does (``test_fabric_misuse.py``,
section 4). The loops are ``tests/_fabric.py``'s ``accumulator_loop`` (``shape="windows"``); LitGPT's plain loop is
the control that must miss.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _fabric import (
    GLOO,
    LOADERS,
    _ForkedModelParallel,
    accumulator_loop,
    fabric_for,
    forked_ranks,
    full_state,
    launched,
    parallelize,
    plain_loop,
    ragged,
    reference,
    setup,
    shifted_loss,
)
from _harness import EXACT, MODES, SHORT_TIMEOUT, Batch, empty_like, relative_error
from lightning.fabric import Fabric

from token_mean import count_shifted_labels
from token_mean._trace import read_trace
from token_mean.fabric import BatchWindow, TokenMeanAccumulator
from token_mean.fabric_monitor import FabricMonitor

K = 3
MISSES = 1e-6  # the control misses the reference by more than this


def datasets() -> dict[str, list[list[Batch]]]:
    """7 ragged batches per rank (windows of 3, 3 and a short 1), one micro-batch without a target; ``uneven``: rank
    1 has 5, so its last two micro-batches are fillers."""
    even = ragged(2, 7, seed=61)
    even[0][1] = empty_like(even[0][1])
    uneven = ragged(2, 7, seed=62)
    uneven[1] = uneven[1][:5]
    return {"even": even, "uneven": uneven}


def both_shapes(fabric: Fabric, mode: str, loaders: tuple[str, ...] = LOADERS) -> dict[str, Any]:
    """Per data set and loader: the windows() loop's parameters and windows' (length, N), the batches() loop's
    parameters; and LitGPT's loop on the even data (the control)."""
    results: dict[str, Any] = {"plain": plain_loop(fabric, datasets()["even"], K)}
    for name, data in datasets().items():
        for loader in loaders:
            windows: list[dict[str, Any]] = []
            by_windows = accumulator_loop(fabric, data, K, mode, windows=windows, loader=loader, shape="windows")
            results[f"{name}-{loader}"] = {
                "windows": by_windows, "batches": accumulator_loop(fabric, data, K, mode, loader=loader),
                "stats": [(window["window_length"], window["global_count"]) for window in windows],
            }
    return results


def check_both_shapes(results: dict[str, Any], loaders: tuple[str, ...] = LOADERS) -> None:
    expected_even, _ = reference(datasets()["even"], K)
    assert relative_error(results["plain"], expected_even) > MISSES, "LitGPT's loop matched: the test cannot fail"
    for name, data in datasets().items():
        expected, counts = reference(data, K)
        for loader in loaders:
            result = results[f"{name}-{loader}"]
            error = relative_error(result["windows"], expected)
            assert error < EXACT, f"{name}/{loader}: {error:.3e}"
            lengths = [3, 3, 3 if loader == "unsized" else 1]  # a stream's end is not known ahead: fillers pad it
            assert result["stats"] == list(zip(lengths, counts, strict=True)), f"{name}/{loader}"
            for key, value in result["batches"].items():
                assert torch.equal(result["windows"][key], value), f"{name}/{loader}: {key} differs from batches()"


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_ddp_matches_the_reference_and_the_batches_loop(mode: str) -> None:
    """2 forked DDP ranks, lists and Fabric loaders (sized, unsized), even ranks and uneven ones (fillers)."""
    check_both_shapes(launched(forked_ranks(), both_shapes, mode))


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_loader_workers_match_the_reference(mode: str) -> None:
    """The batches made in 2 persistent DataLoader worker processes per rank (shared memory)."""
    check_both_shapes(launched(forked_ranks(), both_shapes, mode, ("workers",)), ("workers",))


def parallelize_summed(model: Any, mesh: Any) -> Any:
    """torchtitan's setup: FSDP2 sums the gradients over the data-parallel ranks (divide factor 1)."""
    model = parallelize(model, mesh)
    model.set_gradient_divide_factor(1.0)
    return model


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "parallelize_fn",
    [
        parallelize,
        pytest.param(
            parallelize_summed,
            marks=pytest.mark.skipif(torch.__version__ < (2, 8), reason="torch < 2.8 keeps no divide factor (refused)"),
        ),
    ],
    ids=["mean", "summed"],
)
def test_fsdp2_matches_the_reference_and_the_batches_loop(mode: str, parallelize_fn: Any) -> None:
    """``ModelParallelStrategy`` (FSDP2, DP = 2), lists; FSDP2's mean over the ranks, or a sum
    (``set_gradient_divide_factor(1.0)``: each loss is scaled by 1·n/N in place of P·n/N)."""
    strategy = _ForkedModelParallel(parallelize_fn=parallelize_fn, data_parallel_size=2, tensor_parallel_size=1,
                                    timeout=SHORT_TIMEOUT, **GLOO)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    check_both_shapes(launched(fabric, both_shapes, mode, ("list",)), ("list",))


# ---------------------------------------------------------------------------------------------------------------
# one device: what the loader yields, resume, the monitor
# ---------------------------------------------------------------------------------------------------------------


def one_device(mode: str) -> tuple[Any, Any, TokenMeanAccumulator, list[Batch]]:
    """K = 2 on one device and 5 batches (windows of 2, 2 and a short 1)."""
    fabric = fabric_for("single")
    model, optimizer = setup(fabric)
    return model, optimizer, accumulator_for(fabric, model, mode), ragged(1, 5, seed=63)[0]


def accumulator_for(fabric: Fabric, model: Any, mode: str) -> TokenMeanAccumulator:
    return TokenMeanAccumulator(fabric, model, accumulate=2, mode=mode, count_fn=count_shifted_labels)


def train(accumulator: TokenMeanAccumulator, model: Any, optimizer: Any, data: list[Batch],
          stop_after: int | None = None) -> None:
    """One pass of the windows() loop; ``stop_after``: leave it after that window's step."""
    for index, window in enumerate(accumulator.windows(data)):
        for batch in window:
            accumulator.backward(shifted_loss(model, batch))
        window.finish()
        optimizer.step()
        optimizer.zero_grad()
        if index == stop_after:
            break


class Counted:
    """The batches, counting how many the pass has read."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches, self.read = batches, 0

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.batches:
            self.read += 1
            yield batch


@pytest.mark.parametrize("mode", MODES)
def test_a_window_ends_without_reading_further_than_batches(mode: str) -> None:
    """After each window's last batch the windows() loop has read as many batches as the batches() loop had when
    its ``accumulating`` turned False: the inner loop stops at the window's end, before the pass reads on. The
    read-ahead is the core's: lookahead has read the next window there, deferred one batch (a window of 2 ends after
    3 reads), so a window that took one batch more would read one more in either mode."""
    read: dict[str, list[int]] = {}
    for shape in ("batches", "windows"):
        model, _, accumulator, data = one_device(mode)
        counted, read[shape] = Counted(data), []
        if shape == "batches":
            for batch in accumulator.batches(counted):
                accumulator.backward(shifted_loss(model, batch))
                if not accumulator.accumulating:
                    read[shape].append(counted.read)
                    accumulator.finish()
        else:
            for window in accumulator.windows(counted):
                for batch in window:
                    accumulator.backward(shifted_loss(model, batch))
                read[shape].append(counted.read)
                window.finish()
    assert read["windows"] == read["batches"]
    assert read["windows"] == ([4, 5, 5] if mode == "lookahead" else [3, 5, 5])


@pytest.mark.parametrize("mode", MODES)
def test_resuming_at_a_window_boundary(mode: str) -> None:
    """Two passes; the first run leaves the loop after window 2's step (mid-pass) with the accumulator's state; a new
    accumulator on the same model and optimizer loads it and trains the rest: the reference over both passes.
    Control: without ``load_state_dict`` the resumed pass retrains batches 0..3 and misses."""
    errors = {}
    for resumed in (True, False):
        fabric = fabric_for("single")
        model, optimizer = setup(fabric)
        data = ragged(1, 5, seed=63)[0]
        accumulator = accumulator_for(fabric, model, mode)
        train(accumulator, model, optimizer, data, stop_after=1)
        state = accumulator.state_dict()
        assert state["position"] == 4
        accumulator = accumulator_for(fabric, model, mode)
        if resumed:
            accumulator.load_state_dict(state)
        for _ in range(2):
            train(accumulator, model, optimizer, data)
        errors[resumed] = relative_error(full_state(model), reference([data], 2, epochs=2)[0])
    assert errors[True] < EXACT, f"{errors[True]:.3e}"
    assert errors[False] > MISSES


def test_the_monitor_traces_the_windows_loop_as_the_batches_loop(tmp_path: Path) -> None:
    """``FabricMonitor``'s trace of the windows() loop (N, loss, gradient norm before the step, parameter norm after
    it) is the batches() loop's, row for row. Control: its 3 windows' rows differ."""
    traces = {}
    for shape in ("batches", "windows"):
        monitor = FabricMonitor(record=tmp_path / f"{shape}.csv")
        accumulator_loop(fabric_for("single"), ragged(1, 6, seed=64), 2, "lookahead", monitor=monitor, shape=shape)
        monitor.close()
        traces[shape] = read_trace(tmp_path / f"{shape}.csv")
    assert traces["windows"] == traces["batches"]
    assert sorted(traces["windows"]) == [0, 1, 2]
    assert len({row["param_norm"] for row in traces["windows"].values()}) == 3


# ---------------------------------------------------------------------------------------------------------------
# misuse is an error at once, naming the batch (the batches() loop's own errors where the misuse is the same)
# ---------------------------------------------------------------------------------------------------------------


def misused(mode: str, misuse: str) -> None:
    """The windows() loop on one device (K = 2, windows of batches 0-1, 2-3, 4) with one thing done wrong."""
    model, optimizer, accumulator, data = one_device(mode)
    for index, window in enumerate(accumulator.windows(data)):
        for batch in [] if misuse.startswith("not-iterated") else window:
            if not (misuse == "no-backward-last" and not window.accumulating):
                accumulator.backward(shifted_loss(model, batch))
            if misuse == "break-mid-window":
                break
        if misuse == "not-iterated" or (misuse == "no-finish" and index == 0) or (
                misuse == "no-finish-at-the-end" and index == 2):
            continue
        window.finish()
        if misuse == "finish-twice":
            window.finish()
        if misuse == "iterated-twice":
            list(window)
        optimizer.step()
        optimizer.zero_grad()


MISUSES = {
    "break-mid-window": r"A window of `accumulator\.windows\(\.\.\.\)` was finished or left at batch 0, before its"
                        r" last micro-batch: iterate each window to its end \(`for batch in window:` without `break`\)",
    "not-iterated": r"A window of `accumulator\.windows\(\.\.\.\)` was finished or left at batch 0, before its last",
    "not-iterated-finished": r"A window of `accumulator\.windows\(\.\.\.\)` was finished or left at batch 0",
    "no-backward-last": r"`accumulator\.finish\(\)` comes before the window's last backward \(batch 1\)",
    "no-finish": r"`accumulator\.finish\(\)` was not called after the last micro-batch of the window ending at batch 1",
    "no-finish-at-the-end": r"`accumulator\.finish\(\)` was not called after the last micro-batch of the window ending"
                            r" at batch 4",
    "finish-twice": r"`accumulator\.finish\(\)` is called twice \(batch 1\)",
    "iterated-twice": r"A window of `accumulator\.windows\(\.\.\.\)` is iterated twice",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("misuse", list(MISUSES))
def test_loop_misuse(mode: str, misuse: str) -> None:
    """Each misuse raises a RuntimeError at once, or when the loop asks for the next window (the end of the pass
    for the last one). Control: the loop done right trains exactly (the tests above)."""
    with pytest.raises(RuntimeError, match=MISUSES[misuse]):
        misused(mode, misuse)


@pytest.mark.parametrize("mode", MODES)
def test_a_window_without_its_last_backward(mode: str) -> None:
    """Between the window's last batch and its backward, ``window.finish()`` raises (as ``accumulator.finish()``
    does) and the next window is refused, naming the batch."""
    model, _, accumulator, data = one_device(mode)
    windows = accumulator.windows(data)
    window = next(windows)
    assert isinstance(window, BatchWindow)
    for batch in window:
        assert window.accumulating is accumulator.accumulating
        if window.accumulating:
            accumulator.backward(shifted_loss(model, batch))
    with pytest.raises(RuntimeError, match=r"`accumulator\.finish\(\)` comes before the window's last backward"
                                           r" \(batch 1\)"):
        window.finish()
    with pytest.raises(RuntimeError, match=r"`accumulator\.backward\(loss\)` was not called for batch 1"):
        next(windows)


@pytest.mark.parametrize(("first", "second"), [("batches", "windows"), ("windows", "batches"),
                                               ("windows", "windows")])
def test_one_pass_at_a_time(first: str, second: str) -> None:
    """``windows()`` while a pass of ``batches()`` is iterated, and the other way round: the message names the
    pass in progress."""
    *_, accumulator, data = one_device("lookahead")
    started = getattr(accumulator, first)(data)
    next(started)
    with pytest.raises(RuntimeError, match=rf"`accumulator\.{first}\(\.\.\.\)` is already being iterated: one pass"
                                           " at a time"):
        getattr(accumulator, second)(data)


@pytest.mark.parametrize("mode", MODES)
def test_two_window_passes_zipped(mode: str) -> None:
    model, _, accumulator, data = one_device(mode)
    with pytest.raises(RuntimeError, match=r"`accumulator\.windows\(\.\.\.\)` is already being iterated"):
        for first, _ in zip(accumulator.windows(data), accumulator.windows(data), strict=True):
            for batch in first:
                accumulator.backward(shifted_loss(model, batch))


@pytest.mark.parametrize("mode", MODES)
def test_leaving_inside_a_window_keeps_the_batches_loops_guard(mode: str) -> None:
    """Leaving the windows mid-window leaves the pass there, as a break out of batches() does: the next pass refuses
    the partial gradient until ``zero_grad``. Control: after ``zero_grad`` the next pass trains."""
    model, optimizer, accumulator, data = one_device(mode)
    for window in accumulator.windows(data):
        for batch in window:
            accumulator.backward(shifted_loss(model, batch))
            break
        break
    with pytest.raises(RuntimeError, match=r"ended inside a window \(after batch 0\)"):
        train(accumulator, model, optimizer, data)
    optimizer.zero_grad()
    train(accumulator, model, optimizer, data)
    assert accumulator.last_window is not None and accumulator.last_window.window_length == 1


def left_mid_window(fabric: Fabric, data: list[list[Batch]], mode: str) -> None:
    """The windows() loop on every rank, each leaving its first window after one batch."""
    model, optimizer = setup(fabric)
    accumulator = accumulator_for(fabric, model, mode)
    for window in accumulator.windows(data[fabric.global_rank]):
        for batch in window:
            with fabric.no_backward_sync(model, enabled=window.accumulating):
                accumulator.backward(shifted_loss(model, batch))
            break
        window.finish()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_every_rank_raises_the_same(tmp_path: Path, mode: str) -> None:
    """A loop error is local: on 2 DDP ranks running the same loop, each raises it, with the same message."""
    from _fabric_loop import every_rank_raises, one_message

    message = one_message(every_rank_raises(forked_ranks(), tmp_path, left_mid_window, ragged(2, 4, seed=65), mode))
    assert message.startswith("RuntimeError: A window of `accumulator.windows(...)` was finished or left at batch 0")
