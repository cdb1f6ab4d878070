"""Property tests of the window's arithmetic over random multi-rank setups, in one process.

Each fake rank runs in a thread of its own through the real pass (``Passes``, ``Epoch``, ``Reader``) and mode over
``World(size=P, rank=r)`` with ``distributed=False``; only the collectives are stood in for: a channel whose every
exchange is summed (MAX: maxed) over the threads at a barrier, as the all-reduce would, and the gradient reduction,
summed here by hand. In-process, so a hundred random setups (P, K ≤ 4; ragged, empty micro-batches; empty ranks;
short ranks padded with fillers; mean and sum losses; several terms; 'aux_loss'; sized passes and streams) run in
seconds with no process group. Over every setup:

1. the record: each rank's holds its own count; the reduced one N, the loss sum, the real micro-batches, the
   window's length, each rank's count and (lookahead) the next window's N, per term where there are several.
2. the scale: Σ_r ∇(what rank r back-propagated) / P (DDP's mean; deferred: Σ_r ∇ × the rank's D/N, as its hook
   does) equals, in float64 to relative 1e-12, ∇(Σ per-item losses / N) of the unpartitioned window, computed with
   plain torch only (several terms: Σ_t of each one's token mean; 'aux_loss': its mean over real micro-batches).
3. N = 0 on every rank: a zero gradient, never NaN, and the window is skipped.
4. the control: the plain mean of micro-batch means misses that reference, so the comparison can fail.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from _hub import Hub, in_threads
from torch import Tensor

from token_mean._counts import count_valid_labels
from token_mean._epoch import Passes
from token_mean._layout import Layout, World
from token_mean._modes import Deferred, Lookahead
from token_mean._reader import Reader
from token_mean._record import TERM_COUNT, TERM_LOSS_SUM, TERM_NEXT_COUNT, Channel, Exchange, Kind, Reduced, Slot
from token_mean._settings import checked_settings
from token_mean._window import StepOutput
from token_mean.results import WindowStats

pytestmark = pytest.mark.filterwarnings("ignore:token_mean. an accumulation window had no valid items")
CPU, F64, FEATURES, EXACT, IGNORE = torch.device("cpu"), torch.float64, 3, 1e-12, -100
SEEDS = range(40)
Batch = dict[str, Tensor]


# ---- the in-process collectives ---------------------------------------------------------------------------------


class HubChannel(Channel):
    """A channel whose exchanges are reduced over the hub's threads; it keeps (kind, own record, reduced record)."""

    def __init__(self, world: World, hub: Hub, terms: int) -> None:
        super().__init__(world, rank_counts=True, terms=terms)
        self.hub = hub
        self.log: list[tuple[Kind, Tensor, Tensor]] = []

    def _exchange(self, kind: Kind, op: Any, contents: tuple[Any, ...], named: dict[str, Any]) -> Exchange:
        exchange = super()._exchange(kind, op, contents, named)  # distributed=False: numbered, no collective
        own = exchange.record
        exchange.record = self.hub.all_reduce(self.world.rank, own, op)
        self.log.append((kind, own, exchange.record))
        return exchange

    def _all_gather(self, record: Tensor) -> Tensor:
        return self.hub.all_gather(self.world.rank, record)


# ---- random setups, the step, and the plain-torch reference (no token_mean in it) -----------------------------


@dataclass
class Setup:
    mode: str
    size: int  # P
    accumulate: int  # K
    reductions: dict[str, str]  # each term's "mean" or "sum", in TERMS' order ("lm" alone: one term)
    aux: bool  # the step returns an 'aux_loss' (lookahead, one term)
    sized: bool  # a sized pass (its last window may be short), else a stream (windows padded with fillers)
    moved: bool  # a hook copies the batch before the step (lookahead counts it again as received)
    batches: list[list[Batch]]  # each rank's real batches; a shorter rank is padded with fillers

    @property
    def windows(self) -> list[range]:
        length, k = max(map(len, self.batches)), self.accumulate
        return [range(s, min(s + k, length) if self.sized else s + k) for s in range(0, length, k)]

    def real(self, window: range, ranks: range | None = None) -> list[Batch]:
        """The real batches of ``window`` on ``ranks`` (all of them by default), rank by rank."""
        ranks = range(self.size) if ranks is None else ranks
        return [self.batches[r][p] for r in ranks for p in window if p < len(self.batches[r])]

    def counts(self, window: range, rank: int) -> list[float]:
        """Each term's count over ``window``'s real batches on ``rank`` (plain torch)."""
        real = self.real(window, range(rank, rank + 1))
        return [float(sum(int((b[TERMS[name]] != IGNORE).sum()) for b in real)) for name in self.reductions]


TERMS = {"lm": "labels", "tag": "tags"}  # a term's name -> its targets: per token, and per row


def make_setup(mode: str, seed: int, empty: bool = False) -> Setup:
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    size, k = rng.randint(1, 4), rng.randint(1, 4)
    names = list(TERMS) if mode == "lookahead" and rng.random() < 0.4 else ["lm"]
    longest, batches = rng.randint(1, 3 * k), []
    for rank in range(size):
        empty_rank = empty or rng.random() < 0.15  # no valid item in any of the rank's batches
        length = longest if rank == 0 else rng.randint(1, longest)  # a shorter rank gets zero-weight fillers
        batches.append([make_batch(rng, generator, empty_rank or rng.random() < 0.2) for _ in range(length)])
    aux = mode == "lookahead" and len(names) == 1 and rng.random() < 0.5
    reductions = {name: rng.choice(["mean", "sum"]) for name in names}
    return Setup(mode, size, k, reductions, aux, rng.random() < 0.5, rng.random() < 0.3, batches)


def make_batch(rng: random.Random, generator: torch.Generator, empty: bool) -> Batch:
    rows, length = rng.randint(1, 3), rng.randint(1, 4)
    x = torch.randn(rows, length, FEATURES, generator=generator, dtype=F64)
    labels = torch.randint(0, 5, (rows, length), generator=generator)
    tags = torch.randint(0, 3, (rows,), generator=generator)
    keep = 0.0 if empty else rng.uniform(0.5, 1.0)
    labels[torch.rand(rows, length, generator=generator) >= keep] = IGNORE
    tags[torch.rand(rows, generator=generator) >= keep] = IGNORE
    return {"x": x, "labels": labels, "tags": tags}


def item_losses(w: Tensor, batch: Batch, name: str) -> Tensor:
    """The losses of a term's valid items: 0.5 (x·w - y)² per token ("lm") or per row, of its first token ("tag")."""
    key = TERMS[name]
    prediction = batch["x"] @ w if key == "labels" else batch["x"][:, 0] @ w
    valid = batch[key] != IGNORE
    return 0.5 * (prediction[valid] - batch[key][valid].to(F64)) ** 2


def aux_loss(w: Tensor, batch: Batch) -> Tensor:
    return (w * w).sum() * batch["x"].mean()


def step(setup: Setup, w: Tensor, batch: Batch) -> Any:
    """What `training_step` returns: each term's mean (NaN without items) or sum, maybe with an 'aux_loss'."""
    losses = {}
    for name, reduction in setup.reductions.items():
        items = item_losses(w, batch, name)
        losses[name] = items.mean() if reduction == "mean" else items.sum()
    if len(losses) > 1:
        return losses
    return {"loss": losses["lm"], "aux_loss": aux_loss(w, batch)} if setup.aux else losses["lm"]


def reference(setup: Setup, w0: Tensor, window: range) -> tuple[Tensor, float | None]:
    """∇ of the unpartitioned window's objective, Σ over terms of (Σ item losses) / N_t, plus 'aux_loss' averaged
    over the real micro-batches of all ranks; and its token-mean loss (None without items)."""
    w, batches = w0.clone().requires_grad_(), setup.real(window)
    objective, loss = w.sum() * 0.0, None
    for name in setup.reductions:
        items = torch.cat([item_losses(w, batch, name) for batch in batches])
        if items.numel():
            objective = objective + items.sum() / items.numel()
            loss = (loss or 0.0) + float(items.detach().sum()) / items.numel()
    if setup.aux:
        objective = objective + sum(aux_loss(w, batch) for batch in batches) / len(batches)
    return torch.autograd.grad(objective, w)[0], loss


def relative_error(grad: Tensor, want: Tensor) -> float:
    return float((grad - want).norm() / want.norm()) if want.norm() > 0 else float(grad.norm())


# ---- the ranks ---------------------------------------------------------------------------------------------------


def run_rank(setup: Setup, hub: Hub, rank: int, w0: Tensor) -> tuple[list[tuple[Tensor, WindowStats]], HubChannel]:
    """One rank's pass, driven as a front end drives it: each window's gradient (deferred: times the rank's D/N, as
    DDP's hook scales the bucket before its SUM) and stats."""
    world = World(size=setup.size, rank=rank, device=CPU)
    several = len(setup.reductions) > 1
    count_fn = {"lm": count_valid_labels, "tag": lambda b: (b["tags"] != IGNORE).sum()} if several else None
    reduction = setup.reductions if several else setup.reductions["lm"]
    settings = checked_settings(count_fn, reduction, setup.mode, True)
    settings_terms = [name for name, _, _ in settings.terms]  # the names StepOutput takes a mapping's losses of
    channel = HubChannel(world, hub, len(settings.terms))
    mode = (Lookahead if setup.mode == "lookahead" else Deferred)(channel, settings, Layout(world))
    reader = Reader(iter([(batch,) for batch in setup.batches[rank]]).__next__)  # a loader of (batch,) items
    passes = Passes(mode, pad_uneven_ranks=True)
    local = len(setup.batches[rank]) if setup.sized else None
    passes.agree(local, local)
    epoch = passes.begin(reader, 0)
    w, windows = w0.clone().requires_grad_(), []
    while True:
        try:
            batch = epoch.next_item()[0]
        except StopIteration:
            return windows, channel
        position = reader.current.position  # type: ignore[union-attr]
        micro = epoch.micro_batch(position, setup.accumulate, lambda: len(windows))
        if setup.moved:
            batch = {key: value.clone() for key, value in batch.items()}
        output, _ = StepOutput.of(step(setup, w, batch), lambda: w.sum() * 0.0, settings_terms)
        micro.loss_to_backprop(output, batch).backward()
        micro.backward_done()
        if micro.last:
            factor = mode.gradient_factor() if isinstance(mode, Deferred) else 1.0
            windows.append((w.grad * factor, epoch.end_window()))
            w.grad = None


def run(setup: Setup, w0: Tensor) -> list[tuple[list[tuple[Tensor, WindowStats]], HubChannel]]:
    """Every rank's pass, each in its own thread; a rank's error is raised here (and breaks the others' barrier)."""
    hub = Hub(setup.size)
    results = in_threads([partial(run_rank, setup, hub, rank, w0) for rank in range(setup.size)], hub)
    errors = [result for result in results if isinstance(result, BaseException)]
    errors.sort(key=lambda error: isinstance(error, threading.BrokenBarrierError))  # the cause first
    if errors:
        raise errors[0]
    return results


def w_start(seed: int) -> Tensor:
    return torch.randn(FEATURES, generator=torch.Generator().manual_seed(1000 + seed), dtype=F64)


# ---- the properties ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_records_sum_to_the_windows_counts_and_loss_sums(mode: str, seed: int) -> None:
    setup, w0 = make_setup(mode, seed), w_start(seed)
    windows, terms = setup.windows, len(setup.reductions) > 1
    for rank, (_, channel) in enumerate(run(setup, w0)):
        records = [(own, total) for kind, own, total in channel.log if kind is Kind.WINDOW]
        assert len(records) == len(windows), (rank, channel.log)
        for index, (window, (own, total)) in enumerate(zip(windows, records, strict=True)):
            where = (rank, index)
            per_rank = [setup.counts(window, r) for r in range(setup.size)]  # [rank][term]
            following = windows[index + 1] if index + 1 < len(windows) else range(0)
            next_counts = [sum(c) for c in zip(*(setup.counts(following, r) for r in range(setup.size)), strict=True)]
            loss_sums = [sum(float(item_losses(w0, b, n).sum()) for b in setup.real(window)) for n in setup.reductions]
            assert own[Slot.COUNT] == sum(per_rank[rank]), where  # each rank's record: its own count

            reduced = Reduced(Kind.WINDOW, total.tolist(), channel.world, [], len(setup.reductions) if terms else 0)
            assert reduced.in_step() and reduced.lengths_agree() and reduced.clean(), where
            assert reduced[Slot.COUNT] == sum(map(sum, per_rank)), where  # N
            assert reduced[Slot.LOSS_SUM] == pytest.approx(sum(loss_sums), rel=EXACT, abs=1e-300), where
            assert reduced[Slot.REAL] == len(setup.real(window)), where
            assert reduced[Slot.LENGTH] == setup.size * len(window), where
            if terms:  # each term's N_t, loss sum and next N_t, and each rank's count of it
                for t, loss_sum in enumerate(loss_sums):
                    assert reduced.term(t, TERM_COUNT) == sum(c[t] for c in per_rank), where
                    assert reduced.term(t, TERM_LOSS_SUM) == pytest.approx(loss_sum, rel=EXACT, abs=1e-300), where
                    assert reduced.term(t, TERM_NEXT_COUNT) == (next_counts[t] if next_counts else 0.0), where
                    assert reduced.rank_counts(t) == tuple(c[t] for c in per_rank), where
            else:
                assert reduced.rank_counts() == tuple(c[0] for c in per_rank), where
                if mode == "lookahead":  # the next window's N rides in this window's record
                    assert reduced[Slot.NEXT_COUNT] == (next_counts[0] if next_counts else 0.0), where


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_scaled_losses_give_the_gradient_of_the_unpartitioned_token_mean(mode: str, seed: int) -> None:
    setup, w0 = make_setup(mode, seed), w_start(seed)
    ranks = run(setup, w0)
    divisor = setup.size if mode == "lookahead" else 1.0  # DDP's mean; deferred's hook sums the D/N-scaled buckets
    for index, window in enumerate(setup.windows):
        grad = sum(windows[index][0] for windows, _ in ranks) / divisor
        want, loss = reference(setup, w0, window)
        assert isinstance(grad, Tensor) and bool(torch.isfinite(grad).all()), index
        assert relative_error(grad, want) < EXACT, (index, grad, want)
        global_count = sum(sum(setup.counts(window, r)) for r in range(setup.size))
        for rank, (windows, _) in enumerate(ranks):
            stats = windows[index][1]
            assert (stats.global_count, stats.local_count) == (global_count, sum(setup.counts(window, rank))), index
            assert stats.skipped == (loss is None), index
            assert stats.loss == (None if loss is None else pytest.approx(loss, rel=EXACT)), index


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", ["lookahead", "deferred"])
def test_no_items_on_any_rank_give_a_zero_gradient_and_skip_the_window(mode: str, seed: int) -> None:
    setup, w0 = make_setup(mode, seed, empty=True), w_start(seed)
    setup.aux = False  # an 'aux_loss' has a gradient of its own: N = 0 is about the token-mean part
    for windows, _ in run(setup, w0):
        assert len(windows) == len(setup.windows)
        for grad, stats in windows:
            assert bool((grad == 0).all()), grad  # and no NaN: NaN == 0 is false
            assert stats.skipped and stats.global_count == 0 and stats.loss is None


def test_control_the_plain_mean_of_micro_batch_means_misses_the_reference() -> None:
    """Each micro-batch's mean / K, averaged over P (plain DDP; an empty micro-batch adds 0): were it as close on
    every setup, the property above could not fail."""
    errors = []
    for seed in SEEDS:
        setup, w0 = make_setup("lookahead", seed), w_start(seed)
        setup.reductions, setup.aux = {"lm": "mean"}, False
        w = w0.clone().requires_grad_()
        for window in setup.windows:
            want, loss = reference(setup, w0, window)
            means = [torch.nan_to_num(item_losses(w, b, "lm").mean()) for b in setup.real(window)]
            naive = torch.stack(means).sum() / (setup.accumulate * setup.size)
            if loss is not None:
                errors.append(relative_error(torch.autograd.grad(naive, w)[0], want))
    assert max(errors) > 1e-3, max(errors)
