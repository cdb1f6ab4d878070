"""``TokenMeanAccumulator`` under Lightning Fabric: what ``backward`` is given besides the loss, ``num_items`` (checked
against the count, or the count in deferred mode) and ``aux_loss`` (averaged over real micro-batches; refused in
deferred mode), against the float64 plain-torch reference at 1e-12.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _fabric import (
    launched,
    shifted_count,
    shifted_loss,
)
from _fabric_loop import (
    FABRICS,
    MISSES,
    POISON,
    ddp,
    every_rank_raises,
    guarded,
    loss_only,
    one_device,
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
    TokenNet,
    empty_like,
    initial_state,
    make_optimizer,
    relative_error,
    windows_of,
)
from torch import Tensor

from token_mean import (
    DenominatorError,
    count_shifted_labels,
)

# ---------------------------------------------------------------------------------------------------------------
# 6. num_items
# ---------------------------------------------------------------------------------------------------------------


def reports_its_count(model: Any, batch: Batch) -> dict[str, Any]:
    """The loss's own count as ``num_items``: what it averages over (the shifted targets)."""
    return {"loss": shifted_loss(model, batch), "num_items": shifted_count(batch)}


def reports_a_tensor_count(model: Any, batch: Batch) -> dict[str, Any]:
    return {"loss": shifted_loss(model, batch), "num_items": (batch["labels"][:, 1:] != IGNORE_INDEX).sum()}


def misreports_if_poisoned(model: Any, batch: Batch) -> dict[str, Any]:
    """``num_items`` is one more than the loss's count on the marked batch (rank 1's first), right elsewhere."""
    return {"loss": shifted_loss(model, batch), "num_items": shifted_count(batch) + (POISON in batch)}


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("step", [reports_its_count, reports_a_tensor_count, "control"],
                         ids=["int", "tensor", "control-without-num_items"])
def test_deferred_normalizes_by_num_items_without_count_fn(step: Any) -> None:
    """No ``count_fn``: deferred mode takes each micro-batch's count from ``backward(loss, num_items=...)`` (the
    shifted targets the loss averages over) and is exact. Control: without ``num_items`` the default count (every
    valid label, the first position of each row too) normalizes the shifted loss: it misses."""
    data = ragged(2, 5, seed=49)
    expected, counts = reference(data)
    result = launched(ddp(), train, data, "deferred", step=loss_only if step == "control" else step, count_fn=None)
    if step == "control":
        assert relative_error(result["params"], expected) > MISSES
        return
    assert relative_error(result["params"], expected) < EXACT
    assert [window["global_count"] for window in result["windows"]] == counts


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_num_items_agreeing_with_count_fn_is_fine(mode: str) -> None:
    data = ragged(2, 5, seed=50)
    result = launched(ddp(), train, data, mode, step=reports_its_count)
    assert relative_error(result["params"], reference(data)[0]) < EXACT


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_num_items_disagreeing_with_count_fn_raises_on_every_rank(tmp_path: Path, mode: str) -> None:
    """Rank 1's first micro-batch reports one item more than ``count_fn`` counts: the same
    DenominatorError on both ranks at the first window's ``finish()``, naming both definitions and both numbers.
    Control: :func:`test_num_items_agreeing_with_count_fn_is_fine`."""
    data = poisoned(0)
    marked = data[1][0]
    message = one_message(every_rank_raises(ddp(), tmp_path, guarded, tmp_path, data, mode, count_shifted_labels,
                                            misreports_if_poisoned))
    assert message.startswith("DenominatorError: token_mean: rank 1: `count_fn(batch)` and the 'num_items'"), message
    assert ", in the accumulation window of optimizer step 0 (pass 1, batches 0..1)." in message, message
    assert "rank 1: `count_fn(batch)` and the 'num_items'" in message and "disagree" in message, message
    numbers = f"'num_items' sums to {shifted_count(marked) + 1:g}, the count to {shifted_count(marked):g}"
    assert numbers in message, message
    state = torch.load(tmp_path / "state0.pt", weights_only=True)
    assert (state["where"], state["steps"]) == ("finish", 0)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_lookahead_without_count_fn_checks_num_items_against_the_default_count(tmp_path: Path) -> None:
    """Lookahead counts before the forward, so ``num_items`` cannot be its count: without ``count_fn`` it is checked
    against the default count, and the shifted loss's ``num_items`` raises on every rank, pointing at
    ``count_shifted_labels`` (the difference is exactly the first-position labels). Control: deferred normalizes by
    the same ``num_items`` (:func:`test_deferred_normalizes_by_num_items_without_count_fn`)."""
    data = ragged(2, 4, seed=51)
    message = one_message(every_rank_raises(ddp(), tmp_path, train, data, "lookahead", step=reports_its_count,
                                            count_fn=None))
    assert message.startswith("DenominatorError: "), message
    assert "ranks 0, 1: the default count (`batch['labels'] != -100`) and the 'num_items'" in message, message
    assert "use `count_fn=token_mean.count_shifted_labels`" in message, message


# ---------------------------------------------------------------------------------------------------------------
# 7. aux_loss
# ---------------------------------------------------------------------------------------------------------------

Z_WEIGHT = 0.3


def z_loss(logits: Tensor) -> Tensor:
    """An auxiliary term over every position of the micro-batch, masked or not (like a router z-loss)."""
    return Z_WEIGHT * logits.logsumexp(-1).square().mean()


def loss_and_aux(model: Any, batch: Batch, reduction: str = "mean") -> tuple[Tensor, Tensor]:
    """One forward: the shifted loss (LitGPT's clamped mean, or the sum) and the z-loss of the same logits."""
    logits = model(batch["x"])
    targets = batch["labels"][:, 1:]
    total = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    loss = total if reduction == "sum" else total / (targets != IGNORE_INDEX).sum().clamp(min=1)
    return loss, z_loss(logits)


def with_aux(model: Any, batch: Batch) -> dict[str, Any]:
    loss, aux = loss_and_aux(model, batch)
    return {"loss": loss, "aux_loss": aux}


def folded(model: Any, batch: Batch) -> dict[str, Any]:
    """What a loop without ``aux_loss`` does: the sum as one loss, which the count then weighs per micro-batch."""
    loss, aux = loss_and_aux(model, batch)
    return {"loss": loss + aux}


def aux_reference(data: list[list[Batch]], accumulate: int) -> tuple[dict[str, Tensor], list[tuple[float, float]]]:
    """Per window: Σ shifted loss sums / N + Σ z-loss / M over the window's real micro-batches of every rank (fillers
    excluded, empty micro-batches included); returns the final parameters and each window's (loss, aux) before its
    update."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    parts = []
    for window in windows_of(max(len(rank) for rank in data), accumulate):
        micro_batches = [rank[i] for rank in data for i in window if i < len(rank)]
        total = sum(shifted_count(b) for b in micro_batches)
        optimizer.zero_grad()
        terms = [loss_and_aux(net, b, "sum") for b in micro_batches]
        main = sum(loss for loss, _ in terms) / total
        aux = sum(aux for _, aux in terms) / len(micro_batches)
        assert isinstance(main, Tensor) and isinstance(aux, Tensor)
        parts.append((float(main.detach()), float(aux.detach())))
        (main + aux).backward()
        optimizer.step()
    return {k: v.detach() for k, v in net.state_dict().items()}, parts


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("step", [with_aux, folded], ids=["aux_loss", "control-folded"])
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_aux_loss_is_averaged_over_the_windows_real_micro_batches(layout: str, step: Any) -> None:
    """Rank 1 has 4 batches to rank 0's 7 (K = 3: fillers in windows 2 and 3) and rank 0's batch 1 is empty (its z-loss
    still counts). Lookahead is exact against the reference, and each window reports its token-mean loss and its
    mean z-loss. Control: the sum passed as one loss (weighted by the micro-batch's count) misses."""
    data = ragged(2, 7, seed=52)
    data[1] = data[1][:4]
    data[0][1] = empty_like(data[0][1])
    expected, parts = aux_reference(data, 3)
    result = launched(FABRICS[layout](), train, data, "lookahead", accumulate=3, step=step)
    if step is folded:
        assert relative_error(result["params"], expected) > MISSES, "the folded loss matched: the test cannot fail"
        return
    assert relative_error(result["params"], expected) < EXACT, f"{relative_error(result['params'], expected):.3e}"
    reported = [value for window in result["windows"] for value in (window["loss"], window["aux_loss"])]
    assert reported == pytest.approx([value for pair in parts for value in pair], rel=EXACT)


def test_deferred_refuses_aux_loss() -> None:
    """Deferred mode only knows the token scale after the window's last backward: an ``aux_loss`` is a problem the
    window raises on every rank at its end, before the update. Control: lookahead takes it (the test above)."""
    _, model, optimizer, accumulator, data = one_device("deferred")
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with pytest.raises(DenominatorError, match=r"^token_mean: rank 0: an 'aux_loss' came with the loss under"
                                               r" `mode='deferred'`[\s\S]*Fix: use `mode='lookahead'`"):
        for batch in accumulator.batches(data):
            accumulator.backward(**with_aux(model, batch))
            if not accumulator.accumulating:
                accumulator.finish()
                optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
