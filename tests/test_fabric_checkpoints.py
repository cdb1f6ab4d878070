"""``TokenMeanAccumulator`` under Lightning Fabric: a checkpoint at a window boundary resumes exactly (DDP and FSDP2,
even and uneven ranks, a pass left early, another ``accumulate``), against the uninterrupted run and the float64
plain-torch reference at 1e-12.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from _fabric import (
    data_rank,
    full_state,
    launched,
    setup,
    shifted_count,
    shifted_loss,
)
from _fabric_loop import (
    FABRICS,
    MISSES,
    K,
    ddp,
    one_device,
    ragged,
    reference,
)
from _harness import (
    EXACT,
    MODES,
    Batch,
    reference_steps,
    relative_error,
)
from lightning.fabric import Fabric
from torch import Tensor

from token_mean import (
    count_shifted_labels,
)
from token_mean.fabric import TokenMeanAccumulator

# ---------------------------------------------------------------------------------------------------------------
# 8. checkpoints at a window boundary
# ---------------------------------------------------------------------------------------------------------------


def checkpointed(
    fabric: Fabric,
    data: list[list[Batch]],
    mode: str,
    path: Path,
    phase: str,
    save_after: int,
    as_object: bool = False,
    epochs: int = 2,
    accumulate: int = K,
) -> dict[str, Tensor]:
    """Two passes, K = ``accumulate``. ``phase``: "whole" trains them uninterrupted; "first" saves model, optimizer,
    accumulator and pass with ``fabric.save`` after window ``save_after``'s optimizer step (inside the loop) and stops
    there; "resumed" is a fresh run that ``fabric.load``s that checkpoint and runs the loop to the end.
    ``as_object``: the accumulator itself goes into the state (Fabric calls its ``state_dict``/``load_state_dict``),
    else its dict."""
    model, optimizer = setup(fabric)
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=accumulate, mode=mode, count_fn=count_shifted_labels,
                                       loss_fn=shifted_loss)
    first_pass = 0
    if phase == "resumed":
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "pass": None,
                                 "accumulator": accumulator if as_object else None}
        fabric.load(path, state)
        if not as_object:
            accumulator.load_state_dict(state["accumulator"])
        first_pass = state["pass"]
    windows = 0
    for pass_ in range(first_pass, epochs):
        for batch in accumulator.batches(data[data_rank(fabric)]):
            with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
                accumulator.backward(shifted_loss(model, batch))
            if not accumulator.accumulating:
                accumulator.finish()
                optimizer.step()
                optimizer.zero_grad()
                windows += 1
                if phase == "first" and windows == save_after:
                    saved = accumulator if as_object else accumulator.state_dict()
                    fabric.save(path, {"model": model, "optimizer": optimizer, "accumulator": saved, "pass": pass_})
                    return full_state(model)
    return full_state(model)


CHECKPOINTS = [  # (id, batches of rank 0 and rank 1, window after which the checkpoint is written)
    ("end-of-pass", (4, 4), 2),
    ("end-of-pass-uneven", (4, 3), 2),
    ("mid-pass", (7, 7), 2),
    ("mid-pass-second-pass", (5, 5), 4),
    ("mid-pass-rank-1-ran-out", (7, 3), 2),
    ("mid-pass-rank-1-ends-there", (7, 4), 2),
]


def checkpoint_cases(layouts: Sequence[str]) -> list[Any]:
    return [
        pytest.param(layout, lengths, save_after, id=f"{layout}-{name}")
        for layout in layouts
        for name, lengths, save_after in CHECKPOINTS
    ]


def resume_once(tmp_path: Path, layout: str, mode: str, lengths: tuple[int, int], save_after: int,
                as_object: bool = False) -> None:
    data = [rank[:length] for rank, length in zip(ragged(2, max(lengths), seed=53), lengths, strict=True)]
    expected, _ = reference(data, epochs=2)
    path = tmp_path / "checkpoint"
    whole = launched(FABRICS[layout](), checkpointed, data, mode, path, "whole", save_after, as_object)
    assert relative_error(whole, expected) < EXACT
    launched(FABRICS[layout](), checkpointed, data, mode, path, "first", save_after, as_object)
    resumed = launched(FABRICS[layout](), checkpointed, data, mode, path, "resumed", save_after, as_object)
    assert relative_error(resumed, whole) < EXACT, f"resumed vs uninterrupted: {relative_error(resumed, whole):.3e}"
    assert relative_error(resumed, expected) < EXACT


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("layout", "lengths", "save_after"), checkpoint_cases(["ddp"]))
def test_resuming_at_a_window_boundary_is_exact(
    tmp_path: Path, layout: str, lengths: tuple[int, int], save_after: int, mode: str
) -> None:
    """Train, save after window ``save_after``'s step, resume in a fresh run: its final parameters equal the
    uninterrupted run's and the reference over both passes. Control: the first run's parameters at the checkpoint are
    not the final ones (:func:`test_a_checkpoint_is_not_the_end`), so a resume that trained nothing would miss."""
    resume_once(tmp_path, layout, mode, lengths, save_after)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["lookahead"])
@pytest.mark.parametrize(("layout", "lengths", "save_after"), [
    case for case in checkpoint_cases(["fsdp2"]) if case.id in ("fsdp2-end-of-pass", "fsdp2-mid-pass")
])
def test_resuming_at_a_window_boundary_is_exact_under_fsdp2(
    tmp_path: Path, layout: str, lengths: tuple[int, int], save_after: int, mode: str
) -> None:
    """FSDP2 (DP = 2): Fabric saves a sharded folder (``.distcp`` shards and ``meta.pt``, which holds the
    accumulator's state); the resume is exact as under DDP."""
    resume_once(tmp_path, layout, mode, lengths, save_after)
    assert (tmp_path / "checkpoint").is_dir() and (tmp_path / "checkpoint" / "meta.pt").exists()


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_the_accumulator_itself_goes_into_fabric_save(tmp_path: Path, mode: str) -> None:
    """``fabric.save(path, {..., "accumulator": accumulator})``: Fabric calls ``state_dict()`` and, in ``fabric.load``,
    ``load_state_dict()`` on it (the accumulator is ``_Stateful``)."""
    resume_once(tmp_path, "ddp", mode, (4, 4), 2, as_object=True)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_checkpoint_is_not_the_end(tmp_path: Path) -> None:
    """The control of the resume tests: what the first run stopped at differs from the end of training."""
    data = ragged(2, 4, seed=53)
    stopped = launched(ddp(), checkpointed, data, "lookahead", tmp_path / "checkpoint", "first", 2)
    assert relative_error(stopped, reference(data, epochs=2)[0]) > MISSES


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_mid_window_raises(mode: str) -> None:
    """Fabric saves no partial gradient: ``state_dict()`` raises until the window's ``finish()``, and works after it
    and between passes."""
    _, model, optimizer, accumulator, data = one_device(mode)
    for index, batch in enumerate(accumulator.batches(data)):
        if index == 0:
            with pytest.raises(RuntimeError, match=r"`accumulator\.state_dict\(\)` in the middle of a window: its"
                                                   r" partial gradient is not saved\. Save after"
                                                   r" `accumulator\.finish\(\)`"):
                accumulator.state_dict()
        accumulator.backward(shifted_loss(model, batch))
        if index == 0:
            with pytest.raises(RuntimeError, match="in the middle of a window"):
                accumulator.state_dict()
        if not accumulator.accumulating:
            accumulator.finish()
            optimizer.step()
            optimizer.zero_grad()
            assert accumulator.state_dict()["position"] == index + 1
    assert accumulator.state_dict()["position"] == 0


def warned(fabric: Fabric, function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``function(fabric, ...)`` and the warnings it gave on this rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = function(fabric, *args, **kwargs)
    return result, [str(warning.message) for warning in caught if "token_mean" in str(warning.message)]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_resuming_a_pass_with_another_k_warns_and_each_window_is_exact(tmp_path: Path, mode: str) -> None:
    """Saved with K = 2 after window 2 (batches 0..3 of 7), resumed with K = 3: windows are K apart from the pass's
    start, so the first resumed window holds batches 4 and 5 only; the resume warns once, naming them. Reference:
    [0, 1] [2, 3] | [4, 5] [6], then [0, 1, 2] [3, 4, 5] [6]. Control: the rule "K batches from the resume"
    ([4, 5, 6]) misses."""
    data = ragged(2, 7, seed=53)
    path = tmp_path / "checkpoint"
    launched(ddp(), checkpointed, data, mode, path, "first", 2)
    resumed, messages = launched(ddp(), warned, checkpointed, data, mode, path, "resumed", 2, accumulate=3)
    (message,) = messages
    assert message.startswith("token_mean: resuming in the middle of a pass, at batch 4, with `accumulate=3` where"
                              " the checkpoint was written with 2"), message
    assert "the first window after the resume holds batches 4..5" in message, message

    def steps(windows: Sequence[Sequence[int]]) -> list[list[Batch]]:
        return [[rank[i] for rank in data for i in window if i < len(rank)] for window in windows]

    exact = reference_steps(steps([[0, 1], [2, 3], [4, 5], [6], [0, 1, 2], [3, 4, 5], [6]]),
                            loss_sum=lambda net, batch: shifted_loss(net, batch, "sum"), count=shifted_count)[0]
    other = reference_steps(steps([[0, 1], [2, 3], [4, 5, 6], [0, 1, 2], [3, 4, 5], [6]]),
                            loss_sum=lambda net, batch: shifted_loss(net, batch, "sum"), count=shifted_count)[0]
    assert relative_error(resumed, exact) < EXACT, f"{relative_error(resumed, exact):.3e}"
    assert relative_error(resumed, other) > MISSES


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_resuming_with_the_same_k_does_not_warn(tmp_path: Path) -> None:
    data = ragged(2, 7, seed=53)
    path = tmp_path / "checkpoint"
    launched(ddp(), checkpointed, data, "lookahead", path, "first", 2)
    _, messages = launched(ddp(), warned, checkpointed, data, "lookahead", path, "resumed", 2)
    assert messages == []
