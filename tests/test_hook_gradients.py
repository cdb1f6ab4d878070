"""What ``on_after_backward`` and ``on_before_optimizer_step`` see, in each mode, against a plain-torch float64 model
of every micro-batch's gradient (docs/modes.md's table, rows "`on_after_backward` at a window's last micro-batch"
and "while accumulating").

Each rank records its whole gradient (FSDP2's shards gathered) in both hooks of every micro-batch. The reference
replays the run in plain torch: at each window's weights, every micro-batch's gradient of its loss *sum*, ∇s_rj
(rank r, micro-batch j), and the window's count N; the final gradient is g = Σ_rj ∇s_rj / N, the gradient of the
token mean of the window, and the weights follow g. What each hook sees is then a known combination of the ∇s_rj:

- DDP (Lightning accumulates under ``no_sync``: a micro-batch before the window's last holds this rank's local sum):
  lookahead P·Σ_{j≤i} ∇s_rj / N (the final scale, not yet averaged over ranks), deferred Σ_{j≤i} ∇s_rj / D (loss sums
  over the provisional D); at the window's last micro-batch g in both modes, since deferred's factor D/N rides in the
  DDP all-reduce of that backward, which ends before ``on_after_backward``.
- FSDP2 (Lightning reduce-scatters every micro-batch, averaging over P): lookahead Σ_r Σ_{j≤i} ∇s_rj / N, g at the last;
  deferred Σ_r Σ_{j≤i} ∇s_rj / (P·D), and still that at the last micro-batch: the local shards are multiplied by
  P·D/N after the backward (and after ``on_after_backward``); ``on_before_optimizer_step`` sees g.

The provisional D is the one ``token_mean._deferred`` documents: in the run's first window this rank's first count
times K (under FSDP2 averaged over the ranks, since FSDP2 mixes ranks before any per-rank factor), then the previous
window's N/P.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import (
    MODES,
    Batch,
    TokenModule,
    TokenNet,
    fit,
    full_tensor,
    initial_state,
    make_optimizer,
    ragged_batches,
    strategy_for,
    token_loss,
    windows_of,
)
from _mesh import MeshModule, forked
from torch import Tensor

from token_mean import TokenMeanModelParallelStrategy

K, BATCHES, RANKS = 3, 7, 2  # windows of 3, 3 and 1 micro-batches
GRADIENT_EXACT = 1e-12  # relative to the norm of the gradient it is compared with


class GradientTrace(TokenModule):
    """Each rank saves (hook, batch_idx, whole gradient) for ``on_after_backward`` and ``on_before_optimizer_step``."""

    def __init__(self, data: list[list[Batch]], out: Path) -> None:
        super().__init__(data)
        self.out = out
        self.trace: list[tuple[str, int, Tensor]] = []
        self._batch_idx = -1

    def _gradient(self) -> Tensor:
        return torch.cat([full_tensor(p.grad).flatten() for p in self.net.parameters()])  # type: ignore[arg-type]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_after_backward(self) -> None:
        self.trace.append(("on_after_backward", self._batch_idx, self._gradient()))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.trace.append(("on_before_optimizer_step", self._batch_idx, self._gradient()))

    def on_train_end(self) -> None:
        torch.save(self.trace, self.out / f"trace{self.global_rank}.pt")


class MeshGradientTrace(GradientTrace, MeshModule):
    """The same under FSDP2 (``fully_shard`` over the data-parallel ranks in ``configure_model``)."""


def flat(net: TokenNet) -> Tensor:
    return torch.cat([p.grad.flatten() for p in net.parameters()])  # type: ignore[union-attr]


def micro_batch_gradients(data: list[list[Batch]]) -> list[tuple[list[list[Tensor]], float, list[float]]]:
    """Plain torch, one process, float64: per window, every rank's micro-batch gradients of the loss sum ∇s_rj at the
    window's weights, N, and each rank's first count; the weights follow the token mean's gradient."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    windows = []
    for window in windows_of(BATCHES, K):
        gradients = []
        for rank in data:
            rank_gradients = []
            for i in window:
                net.zero_grad()
                token_loss(net, rank[i], "sum").backward()
                rank_gradients.append(flat(net).clone())
            gradients.append(rank_gradients)
        counts = [[float((rank[i]["labels"] != -100).sum()) for i in window] for rank in data]
        total = sum(map(sum, counts))
        assert total > 0
        offset = 0
        for p in net.parameters():  # the final gradient g, into .grad for the optimizer
            size = p.numel()
            p.grad = (sum(sum(r) for r in gradients) / total)[offset : offset + size].view_as(p).clone()
            offset += size
        optimizer.step()
        windows.append((gradients, total, [rank[0] for rank in counts]))
    return windows


def expected_trace(mode: str, fsdp: bool, data: list[list[Batch]]) -> list[list[tuple[str, int, Tensor]]]:
    """Per rank, (hook, batch_idx, gradient) as the module docstring says each hook sees it."""
    traces: list[list[tuple[str, int, Tensor]]] = [[] for _ in range(RANKS)]
    provisional: list[float] | None = None
    for window, (gradients, total, first_counts) in zip(windows_of(BATCHES, K), micro_batch_gradients(data),
                                                        strict=True):
        if provisional is None:  # the run's first window: this rank's first count times K, at least 1
            estimates = [count * K for count in first_counts]
            provisional = [max(sum(estimates) / RANKS, 1.0)] * RANKS if fsdp else [max(e, 1.0) for e in estimates]
        final = sum(sum(r) for r in gradients) / total
        for rank in range(RANKS):
            for i, batch_idx in enumerate(window):
                last = i == len(window) - 1
                local = sum(gradients[rank][: i + 1])
                everywhere = sum(sum(r[: i + 1]) for r in gradients)
                d = provisional[rank]
                if fsdp:
                    seen = everywhere / total if mode == "lookahead" else everywhere / (RANKS * d)
                elif last:
                    seen = final
                else:
                    seen = RANKS * local / total if mode == "lookahead" else local / d
                traces[rank].append(("on_after_backward", batch_idx, seen))
                if last:
                    traces[rank].append(("on_before_optimizer_step", batch_idx, final))
        provisional = [total / RANKS] * RANKS
    return traces


def assert_trace(out: Path, expected: list[list[tuple[str, int, Tensor]]]) -> None:
    for rank in range(RANKS):
        trace = torch.load(out / f"trace{rank}.pt", weights_only=True)
        assert [(hook, i) for hook, i, _ in trace] == [(hook, i) for hook, i, _ in expected[rank]], rank
        for (hook, i, got), (_, _, want) in zip(trace, expected[rank], strict=True):
            error = float((got - want).norm() / want.norm())
            assert error < GRADIENT_EXACT, f"rank {rank}, batch {i}, {hook}: relative error {error:.3e}"


def hook_data() -> list[list[Batch]]:
    return ragged_batches(RANKS, BATCHES, seed=14)


def modes_differ(fsdp: bool, data: list[list[Batch]]) -> list[bool]:
    """Per ``on_after_backward`` of rank 0: whether the two modes' expected gradients differ (by 1e-3 relative)."""
    lookahead, deferred = (expected_trace(mode, fsdp, data)[0] for mode in MODES)
    return [
        float((a - b).norm() / a.norm()) > 1e-3
        for (hook, _, a), (_, _, b) in zip(lookahead, deferred, strict=True)
        if hook == "on_after_backward"
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_on_after_backward_under_ddp(tmp_path: Path, mode: str) -> None:
    """DDP: before a window's last micro-batch, lookahead's local gradient carries the final scale and deferred's
    holds loss sums over D; at the last micro-batch both modes' ``on_after_backward`` sees the final gradient."""
    data = hook_data()
    # the modes differ at every accumulating micro-batch (D is never N/P here) and agree at each window's last
    assert modes_differ(False, data) == [True, True, False, True, True, False, False]
    fit(GradientTrace(data, tmp_path), strategy_for(mode), tmp_path, accumulate_grad_batches=K)
    assert_trace(tmp_path, expected_trace(mode, False, data))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_on_after_backward_under_fsdp2(tmp_path: Path, mode: str) -> None:
    """FSDP2 (``TokenMeanModelParallelStrategy``, 2 data-parallel ranks): every micro-batch's gradient is reduced;
    deferred's ``on_after_backward`` sees loss sums over P·D even at a window's last micro-batch, and
    ``on_before_optimizer_step`` the final gradient."""
    data = hook_data()
    assert all(modes_differ(True, data))  # deferred's factor P·D/N is never 1 here
    strategy = forked(TokenMeanModelParallelStrategy)(
        mode=mode, data_parallel_size=RANKS, tensor_parallel_size=1, process_group_backend="gloo"
    )
    fit(MeshGradientTrace(data, tmp_path), strategy, tmp_path, RANKS, accumulate_grad_batches=K)
    assert_trace(tmp_path, expected_trace(mode, True, data))
