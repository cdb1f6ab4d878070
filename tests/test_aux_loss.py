"""A loss with an auxiliary term: ``{"loss": token_mean_part, "aux_loss": term}`` (MoE load balancing, z-loss).

The objective of one optimizer step is the token mean of the main loss plus the mean of the auxiliary term over the
window's real micro-batches on all ranks (each weighted 1/M; an empty micro-batch still counts, a zero-weight filler
of an exhausted rank does not), independent of counts and of ``loss_reduction``. The reference below computes exactly
that in plain torch; plain DDP, and the strategy fed the sum as one loss, must miss it.
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
    Batch,
    TokenModule,
    TokenNet,
    empty_like,
    fit,
    initial_state,
    make_optimizer,
    ragged_batches,
    relative_error,
    token_loss,
    windows_of,
)
from _ranks import raises_everywhere
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from token_mean import TokenMeanDDPStrategy

Z_WEIGHT = 0.3


def z_loss(net: nn.Module, batch: Batch) -> Tensor:
    """An auxiliary term over every position of the micro-batch, masked or not (like a router z-loss)."""
    return Z_WEIGHT * net(batch["x"]).logsumexp(-1).square().mean()


def with_aux(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    return {"loss": loss, "aux_loss": z_loss(module.net, batch)}


def folded(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
    """What a user without `aux_loss` writes: the sum as one loss, which the count then weighs per micro-batch."""
    return loss + z_loss(module.net, batch)


def reference(data: list[list[Batch]], accumulate: int, reduction: str = "mean") -> dict[str, Tensor]:
    """Per step: Σ token losses / N + Σ aux / M over every real micro-batch of every rank (fillers excluded)."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    length = max(len(rank) for rank in data)
    for window in windows_of(length, accumulate):
        micro_batches = [rank[i] for rank in data for i in window if i < len(rank)]
        total = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
        optimizer.zero_grad()
        aux = sum(z_loss(net, b) for b in micro_batches) / len(micro_batches)
        main = sum(token_loss(net, b, "sum") for b in micro_batches) / total if total else 0.0
        (main + aux).backward()  # type: ignore[union-attr]
        optimizer.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


def data_with_empty(lengths: tuple[int, int], seed: int) -> list[list[Batch]]:
    data = ragged_batches(2, max(lengths), seed=seed)
    data = [rank[:length] for rank, length in zip(data, lengths, strict=True)]
    data[0][1] = empty_like(data[0][1])  # an empty micro-batch: no token, but its aux term counts
    return data


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("lengths", "accumulate"),
    [((7, 7), 3), ((7, 4), 3), ((5, 5), 1)],
    ids=["short-last-window", "uneven-ranks-fillers", "K1"],
)
def test_aux_loss_is_averaged_over_real_micro_batches(
    tmp_path: Path, lengths: tuple[int, int], accumulate: int
) -> None:
    data = data_with_empty(lengths, seed=sum(lengths) + accumulate)
    expected = reference(data, accumulate)
    strategy = TokenMeanDDPStrategy(**FORK)
    params, windows = fit(TokenModule(data, output_fn=with_aux), strategy, tmp_path, accumulate_grad_batches=accumulate)
    assert relative_error(params, expected) < EXACT
    assert all(window["aux_loss"] is not None for window in windows)
    controls = [("folded", TokenMeanDDPStrategy(**FORK))]
    if lengths[0] == lengths[1]:  # plain DDP cannot run ranks of different lengths at all (it hangs)
        controls.append(("plain", DDPStrategy(**FORK)))
    for name, control in controls:
        output_fn = with_aux if name == "plain" else folded
        missed, _ = fit(
            TokenModule(data, output_fn=output_fn), control, tmp_path / name, accumulate_grad_batches=accumulate
        )
        assert relative_error(missed, expected) > 1e-6, f"{name} matched the objective: the test could not fail"


@pytest.mark.distributed
def test_aux_loss_with_sum_reduction(tmp_path: Path) -> None:
    """`loss_reduction="sum"` changes how the main loss is normalized, not the auxiliary term."""
    data = data_with_empty((6, 6), seed=5)

    def summed(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
        return {"loss": loss, "aux_loss": z_loss(module.net, batch)}

    strategy = TokenMeanDDPStrategy(loss_reduction="sum", **FORK)
    params, _ = fit(TokenModule(data, reduction="sum", output_fn=summed), strategy, tmp_path, accumulate_grad_batches=2)
    assert relative_error(params, reference(data, 2)) < EXACT


@pytest.mark.distributed
def test_logged_window_reports_both_parts(tmp_path: Path) -> None:
    data = data_with_empty((4, 4), seed=9)
    _, windows = fit(TokenModule(data, output_fn=with_aux), TokenMeanDDPStrategy(**FORK), tmp_path,
                     accumulate_grad_batches=2)
    net = TokenNet()
    net.load_state_dict(initial_state())
    first = [rank[i] for rank in data for i in range(2)]
    with torch.no_grad():
        aux = float(sum(z_loss(net, b) for b in first)) / len(first)
        total = sum(int((b["labels"] != -100).sum()) for b in first)
        main = float(sum(token_loss(net, b, "sum") for b in first)) / total
    assert windows[0]["aux_loss"] == pytest.approx(aux, rel=EXACT)
    assert windows[0]["loss"] == pytest.approx(main, rel=EXACT)  # the token-mean part alone


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [(0, 1), (1,)], ids=["every-rank", "rank-1-only"])
def test_aux_loss_is_refused_in_deferred_mode(tmp_path: Path, ranks: tuple[int, ...]) -> None:
    """Refused on every rank before the first update, naming the ranks that returned it: also where one rank alone
    does (a data-dependent term), which must not leave the other waiting in a collective."""
    data = data_with_empty((4, 4), seed=11)

    def some_with_aux(module: TokenModule, batch: Batch, loss: Tensor) -> Any:
        return with_aux(module, batch, loss) if module.global_rank in ranks else loss

    strategy = TokenMeanDDPStrategy(mode="deferred", **FORK)
    errors = raises_everywhere(
        tmp_path / "outcomes",
        lambda: fit(TokenModule(data, output_fn=some_with_aux), strategy, tmp_path, accumulate_grad_batches=2),
    )
    who = "ranks 0, 1" if len(ranks) == 2 else "rank 1"
    for message in errors:
        cause = f"DenominatorError: token_mean: {who}: an 'aux_loss' came with the loss under `mode='deferred'`"
        assert message.startswith(cause), message
        assert re.search(r"mode='deferred'[\s\S]*Fix: use `mode='lookahead'`", message), message
    assert len(set(errors)) == 1
