"""The two ways of bringing a window's global count N to the gradient: a mode lives for a fit, keeps only what
spans windows and opens each window, which does the rest (``_window``).

**Lookahead** counts each window's batches before its first forward: the pass reads window w + 1 while w trains
(at most K batches held), w's one all-reduce carries w + 1's share of N, and the loss scale P·n/N is a host float.
A batch that changed on its way to ``training_step`` is counted again and checked against the count read ahead.

**Deferred** counts each micro-batch after its forward and back-propagates its loss sum over D, a stand-in for N/P
on the device; the final factor D/N reaches the gradient without a host read, inside DDP's bucket all-reduce
(``_comm_hook``) or by one multiplication of the local shards after FSDP2's (``_layout``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from lightning.fabric.utilities import rank_zero_warn
from torch import Tensor

from token_mean._counts import first_labels, read_count
from token_mean._layout import Layout
from token_mean._problems import Problem
from token_mean._reader import Entry, Reader
from token_mean._record import TERM_COUNT, TERM_LOSS_SUM, TERM_NEXT_COUNT, Channel, Kind, Reduced, Slot
from token_mean._settings import Settings
from token_mean._window import (
    Ended,
    MicroBatch,
    StepOutput,
    Window,
    check_global_count,
    count_received,
    mismatch,
    scale_of,
)
from token_mean.results import WindowStats


class Counts(NamedTuple):
    """A window's counts, known before its first forward. An objective of several terms has a tuple of counts at each
    position and a tuple of N, one per term."""

    stop: int  # one past its last position
    local: list[Any]  # this rank's count at each of its positions (0 for a filler)
    global_count: Any  # N
    real: float  # its real micro-batches over all ranks (what 'aux_loss' is averaged over)


class Mode:
    """What spans a fit's windows, whatever the mode: the settings, the channel, the steps skipped."""

    reads_ahead = False  # the pass reads the next window's batches while this one trains

    def __init__(self, channel: Channel, settings: Settings, layout: Layout) -> None:
        self.channel = channel
        self.settings = settings
        self.checks = layout.checks
        self.skipped_steps = 0
        self._saved_accumulate: int | None = None  # K in a checkpoint being resumed, until the first window opens

    @property
    def world_size(self) -> int:
        return self.channel.world.size

    @property
    def divisor(self) -> float:
        """What the gradient reduction divides the ranks' sum by (P for a mean): an item's loss scale is divisor/N."""
        return self.channel.world.divisor

    def open(self, start: int, stop: int, accumulate: int, step: str, counts: Counts | None, reader: Reader) -> Window:
        """The window ``[start, stop)`` with K = ``accumulate``; lookahead: its ``counts`` if the previous window
        counted them in its record, else its batches, read ahead from ``reader``, to count now."""
        raise NotImplementedError

    def count_skipped(self, stats: WindowStats) -> None:
        if stats.skipped:
            self.skipped_steps += 1
            if self.skipped_steps == 1:
                rank_zero_warn(
                    "token_mean: an accumulation window had no valid items on any rank (N = 0); its update was"
                    " skipped, leaving parameters and optimizer state unchanged (under the Trainer, `global_step` and"
                    " step-wise LR schedulers still advance). `skipped_steps` counts such windows."
                )

    def check_resumed_accumulate(self, start: int, accumulate: int) -> None:
        """The first window after a resume: a mid-epoch one whose K differs from the checkpoint's warns."""
        saved, self._saved_accumulate = self._saved_accumulate, None
        if saved is not None and start > 0 and saved != accumulate:
            rank_zero_warn(
                f"token_mean: this run resumed in the middle of an epoch (at batch {start}) with"
                f" `accumulate_grad_batches` = {accumulate}, but the checkpoint was written with {saved}. Lightning"
                " skips `on_train_epoch_start` on a mid-epoch restart, so a `GradientAccumulationScheduler` (or a"
                " callback that sets K there) has not set this epoch's K: the rest of the epoch trains windows of"
                f" {accumulate} micro-batches (plain Lightning does the same), exact for those windows but not the"
                " uninterrupted run. Resume from a checkpoint written at the end of an epoch to keep the schedule."
            )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the mode (identical on every rank)."""
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        saved = state.get("accumulate")
        self._saved_accumulate = None if saved is None else int(saved)


def make_mode(settings: Settings, layout: Layout, rank_counts: bool) -> Mode:
    """The mode ``settings`` name, over ``layout``; ``rank_counts`` adds every rank's count to each record."""
    channel = Channel(layout.world, rank_counts, layout.join_backward, len(settings.terms))
    return (Lookahead if settings.mode == "lookahead" else Deferred)(channel, settings, layout)


class Lookahead(Mode):
    reads_ahead = True

    def open(self, start: int, stop: int, accumulate: int, step: str, counts: Counts | None, reader: Reader) -> Window:
        kind = _TermsWindow if self.settings.terms else _LookaheadWindow
        if counts is not None:
            return kind(self, start, stop, accumulate, step, counts, reader.unchanged)
        # the pass's first window (or the first after K changed): a collective of its own, before its first forward
        entries = reader.entries(start, stop)
        stop = start + len(entries)  # fewer where a loader that yields nothing ends
        nothing = (0.0,) * len(self.settings.terms) if self.settings.terms else 0.0
        window = kind(self, start, stop, accumulate, step, Counts(stop, [], nothing, 0.0), reader.unchanged)
        local, host = self.count_following(entries, window)
        reduced = self.channel.reduce(Kind.FIRST_COUNTS, host, flags=window.flags)
        reduced.check(window.where, window.detail)
        window.set_counts(self.agreed_counts(reduced, stop, local, window, lambda: window.where))
        return window

    def count_following(self, entries: Sequence[Entry], window: Window) -> tuple[list[Any], dict[Slot, float]]:
        """Count ``entries`` as the loader yielded them (on the host), flagging their problems in ``window``: each
        batch's count (with several terms, a tuple of each term's) and the host slots of their sums."""
        terms = self.settings.terms
        counting = [(term.count_fn, f", term {term.name!r}") for term in terms] or [(self.settings.count_fn, "")]
        rows: list[list[float]] = []  # each entry's count of each term
        for entry in entries:
            if entry.aliased:
                window.flag(
                    Problem.ALIASED,
                    f"the batch at position {entry.position} reuses the memory of a batch held before it",
                )
            row = []
            for count_fn, which in counting:
                count, problem, detail = (0.0, None, "") if entry.filler else read_count(count_fn, entry.batch)
                if problem is not None:
                    window.flag(problem, f"the batch at position {entry.position} (read ahead{which}): {detail}")
                row.append(count)
            rows.append(row)
        real = float(sum(not entry.filler for entry in entries))
        host: dict[Slot, float] = {Slot.NEXT_REAL: real, Slot.MORE: float(real > 0)}
        for t in range(len(counting)):
            total = _fsum(row[t] for row in rows)
            if not math.isfinite(total):  # finite counts whose sum overflows float64
                window.flag(Problem.COUNT_RANGE, f"this rank's counts of the window sum to {total}")
                total = 0.0
            host[self.channel.term_slot(t, TERM_NEXT_COUNT) if terms else Slot.NEXT_COUNT] = total  # type: ignore[index]
        return [tuple(row) if terms else row[0] for row in rows], host

    def agreed_counts(
        self, reduced: Reduced, stop: int, local: list[Any], window: Window, where: Callable[[], str]
    ) -> Counts:
        """The counts, read ahead and summed over the ranks, of the window ``where`` names, which ends at ``stop``,
        raising an N that cannot normalize before its use (``window``: the one whose record brought them); several
        terms: an N per term."""
        terms = len(self.settings.terms)
        counts = [reduced.term(t, TERM_NEXT_COUNT) for t in range(terms)] if terms else [reduced[Slot.NEXT_COUNT]]
        for global_count in counts:
            check_global_count(window, global_count, self.divisor * window.accumulate, where)
        return Counts(stop, local, tuple(counts) if terms else counts[0], reduced[Slot.NEXT_REAL])


class _LookaheadWindow(Window):
    mode = "lookahead"

    def __init__(
        self,
        lookahead: Lookahead,
        start: int,
        stop: int,
        accumulate: int,
        step: str,
        counts: Counts,
        unchanged: Callable[[Any], bool],
    ) -> None:
        super().__init__(
            lookahead.channel,
            start,
            stop,
            accumulate,
            step,
            lookahead.settings.loss_reduction,
            lookahead.checks,
            judge_counts=False,
        )  # judged on the host as they were read ahead
        self._lookahead = lookahead
        self._unchanged = unchanged
        self._next_local: list[float] = []
        self.set_counts(counts)

    def set_counts(self, counts: Counts) -> None:
        self._read = counts.local  # this rank's counts, read ahead
        self._n, self._real = counts.global_count, counts.real
        self._share = scale_of(self._lookahead.divisor, self._n)  # the reduction divides by P: an item's share of 1/N

    def _count_of(self, entry: Entry) -> float:
        return 0.0 if entry.filler else self._read[entry.position - self.start]

    def forward_done(self, micro: MicroBatch, output: StepOutput, batch: Any) -> Tensor:
        if micro.filler:
            self.add(0.0, None, filler=True)
        else:
            settings = self._lookahead.settings
            if self._unchanged(batch):  # the very tensors counted as read: only 'num_items' to check
                if output.num_items is not None:
                    reported = self.on_device(output.num_items, "'num_items'")
                    if reported is not None:
                        self.check_equal(mismatch(settings.count_fn_given), reported, micro.count, first_labels(batch))
            else:  # moved to the device or changed by a hook: counted again as received, and the two must agree
                received = count_received(
                    self, batch, output.num_items, settings.count_fn, settings.count_fn_given, False
                )
                self.check_equal(Problem.COUNT_CHANGED, micro.count, received)
            if output.loss is None:
                self.flag(Problem.NO_LOSS)
            self.add(micro.count, output.loss, filler=False, aux=output.aux_loss)
        if micro.last:
            self._next_local, host = self._lookahead.count_following(self._following, self)
            self.close(host)
        return self._scaled(micro, output)

    def _scaled(self, micro: MicroBatch, output: StepOutput) -> Tensor:
        loss = output.backprop
        if micro.count > 0:
            scaled = loss * ((micro.count if self.mean else 1.0) * self._share)
        else:  # the mean of an empty micro-batch is 0/0 = NaN; its backward must still run for the reduction
            scaled = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
        if output.aux_loss is not None:
            real = self._real
            weight = 0.0 if micro.filler or real == 0 else self._lookahead.divisor / real
            scaled = scaled + output.aux_loss * weight
        return scaled

    def end(self) -> Ended:
        """The one host read, which also brings the next window's counts: every problem raised before the update."""
        reduced, local = self.read()
        stop = self.stop + len(self._next_local)
        next_counts = self._lookahead.agreed_counts(
            reduced, stop, self._next_local, self, lambda: self.where_next(stop)
        )
        return Ended(self._stats(reduced, local), reduced[Slot.MORE], reduced[Slot.END_UNREAD] > 0, next_counts)

    def _stats(self, reduced: Reduced, local: float) -> WindowStats:
        real = self._real
        return self.stats(reduced, local, self._n, reduced[Slot.AUX_SUM] / real if self.aux and real else None)

    def where_next(self, stop: int) -> str:
        return f"the accumulation window after that of {self.step}, batches {self.stop}..{stop - 1})"


class _TermsWindow(_LookaheadWindow):
    """A lookahead window of an objective of several terms: each term's counts read ahead, each term's loss scaled by
    P·n_t/N_t (a sum-reduced term by P/N_t), and each term's count and loss sum in three slots of the record."""

    def set_counts(self, counts: Counts) -> None:
        self._read, self._n, self._real = counts.local, counts.global_count, counts.real
        self._shares = [scale_of(self._lookahead.divisor, count) for count in self._n]
        self._term_counts: list[tuple[float, ...]] = []
        self._term_losses: list[list[Tensor | None]] = []

    def _count_of(self, entry: Entry) -> float:
        return 0.0 if entry.filler else _fsum(self._read[entry.position - self.start])

    def forward_done(self, micro: MicroBatch, output: StepOutput, batch: Any) -> Tensor:
        terms = self._lookahead.settings.terms
        counts = (0.0,) * len(terms) if micro.filler else self._read[micro.position - self.start]
        given = output.terms or {}
        losses = [value if isinstance(value := given.get(term.name), Tensor) else None for term in terms]
        if not micro.filler:
            self._check_terms(output, losses, counts, batch)
        kept = [loss for loss, count in zip(losses, counts, strict=True) if loss is not None and count > 0]
        self.add(_fsum(counts), sum(kept[1:], kept[0]) if kept else None, micro.filler)
        self._term_counts.append(counts)
        self._term_losses.append([None if loss is None else loss.detach() for loss in losses])
        if micro.last:
            self._next_local, host = self._lookahead.count_following(self._following, self)
            self.close(host)
        scaled = None
        for loss, count, term, share in zip(losses, counts, terms, self._shares, strict=True):
            if loss is None:
                continue
            if count > 0:
                part = loss * ((count if term.reduction == "mean" else 1.0) * share)
            else:  # an empty term's mean is 0/0 = NaN; its backward must still run for the reduction
                part = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
            scaled = part if scaled is None else scaled + part
        return scaled if scaled is not None else output.backprop * 0.0

    def _check_terms(
        self, output: StepOutput, losses: list[Tensor | None], counts: tuple[float, ...], batch: Any
    ) -> None:
        """The step returned exactly the terms, and counted as read (or as received, and the two agree)."""
        terms = self._lookahead.settings.terms
        names = [term.name for term in terms]
        given = output.terms or {}
        extra = [
            key
            for key, value in given.items()
            if isinstance(value, Tensor) and key not in names and key not in ("loss", "num_items")
        ]
        if output.terms is None or extra or any(loss is None for loss in losses):
            returned = sorted(key for key, value in given.items() if isinstance(value, Tensor))
            self.flag(
                Problem.TERMS_MISMATCH,
                f"`training_step` returned the tensors {returned} where `count_fn` names the terms {sorted(names)}",
            )
        reported = output.num_items if isinstance(output.num_items, Mapping) else {}
        unchanged = self._unchanged(batch)
        for term, count in zip(terms, counts, strict=True):
            name = term.name
            if name in reported and (value := self.on_device(reported[name], f"'num_items[{name!r}]'")) is not None:
                self.check_equal(Problem.NUM_ITEMS_MISMATCH_COUNT_FN, value, count)
            if not unchanged:  # moved to the device or changed by a hook: counted again as received
                received = count_received(self, batch, None, term.count_fn, True, False)
                self.check_equal(Problem.COUNT_CHANGED, count, received)

    def _sums(self, host: dict[Slot, float], device: list[tuple[Slot | tuple[int, ...], Tensor]]) -> float:
        local = _fsum(float(count) for count in self.counts)
        host[Slot.COUNT] = local
        sums = []
        for t, term in enumerate(self._lookahead.settings.terms):
            counts = [term_counts[t] for term_counts in self._term_counts]
            host[self.channel.term_slot(t, TERM_COUNT)] = _fsum(counts)  # type: ignore[index]
            kept = [
                (loss, count if term.reduction == "mean" else 1.0)
                for losses, count in zip(self._term_losses, counts, strict=True)
                if count > 0 and (loss := losses[t]) is not None
            ]
            if kept:
                weighted = torch.stack([loss.to(torch.float64) * weight for loss, weight in kept]).sum()
                device.append((self.channel.term_slot(t, TERM_LOSS_SUM), weighted))  # type: ignore[arg-type]
                sums.append(weighted)
        if sums:  # the record's loss sum: finite exactly when every term's is (the window's health)
            device.append((Slot.LOSS_SUM, torch.stack(sums).sum()))
        return local

    def _stats(self, reduced: Reduced, local: float) -> WindowStats:
        terms = {}
        for t, term in enumerate(self._lookahead.settings.terms):
            global_count = self._n[t]
            loss = None if global_count == 0 else reduced.term(t, TERM_LOSS_SUM) / global_count
            local_count = _fsum(term_counts[t] for term_counts in self._term_counts)
            ranks = reduced.rank_counts(t)
            terms[term.name] = WindowStats(
                global_count, local_count, ranks, self.length, loss, global_count == 0, self.mode
            )
        total = _fsum(self._n)
        objective = _fsum(term.loss for term in terms.values() if term.loss is not None)
        return replace(self.stats(reduced, local, total), loss=None if total == 0 else objective, terms=terms)


def _fsum(values: Iterable[float]) -> float:
    """An exact sum, inf where it overflows float64 (a count problem the window raises, not an OverflowError)."""
    listed = [float(value) for value in values]
    try:
        return math.fsum(listed)
    except OverflowError:
        return sum(listed)


class Deferred(Mode):
    def __init__(self, channel: Channel, settings: Settings, layout: Layout) -> None:
        super().__init__(channel, settings, layout)
        self._after_backward = layout.after_backward
        # D on the device: the previous window's N/P, kept across windows and checkpoints; the run's first
        # micro-batch sizes it
        self._provisional: Tensor | None = None
        self.reducing: _DeferredWindow | None = None  # the window whose last backward reduces the gradient
        layout.install(self)

    def open(self, start: int, stop: int, accumulate: int, step: str, counts: Counts | None, reader: Reader) -> Window:
        return _DeferredWindow(self, start, stop, accumulate, step)

    def provisional(self, first: Tensor | float, accumulate: int) -> Tensor:
        """D, sized by the run's first micro-batch (its count ``first`` times K) when there is none yet.

        Where gradients are averaged before any per-rank factor (``World.gradients_averaged``), every rank must
        divide by the same D: the estimates are averaged over the ranks, one collective once per run (and not after
        a resume, which restores D), read on the device only. Under DDP the hook applies each rank's own D/N.
        """
        if self._provisional is None:
            world = self.channel.world
            estimate = (
                first * accumulate
                if isinstance(first, Tensor)
                else torch.full((), first * accumulate, dtype=torch.float64, device=world.device)
            )
            if world.gradients_averaged and world.distributed:
                exchange = self.channel.start(Kind.PROVISIONAL, device=[(Slot.COUNT, estimate)])
                estimate = exchange.wait()[Slot.COUNT] / world.size
            self._provisional = torch.clamp(estimate.to(torch.float64), min=1.0)
        return self._provisional

    def next_provisional(self, global_count: float) -> None:
        """A window with ``global_count`` items ended: the next windows' backward passes use its N/P as their D."""
        if global_count > 0:
            self._provisional = torch.full(
                (), global_count / self.world_size, dtype=torch.float64, device=self.channel.world.device
            )

    def gradient_factor(self) -> Tensor | float:
        """D/N for the reduction of the window's last backward; waits for the exchange on the device."""
        window = self.reducing
        return 1.0 / self.world_size if window is None else window.gradient_factor()  # outside: the plain mean

    def gradient_final(self, window: _DeferredWindow) -> None:
        """After the window's last backward: its factor into the gradient (where the reduction did not apply it)."""
        self._after_backward(window.gradient_factor)
        self.reducing = None

    # D only changes rounding, but restoring it keeps a resumed run bitwise identical (a host read per checkpoint)
    def state_dict(self) -> dict[str, Any]:
        provisional = None if self._provisional is None else float(self._provisional)
        return {**super().state_dict(), "provisional": provisional}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        value = state.get("provisional")
        if value is not None:
            self._provisional = torch.full((), float(value), dtype=torch.float64, device=self.channel.world.device)


class _DeferredWindow(Window):
    mode = "deferred"

    def __init__(self, deferred: Deferred, start: int, stop: int, accumulate: int, step: str) -> None:
        super().__init__(
            deferred.channel, start, stop, accumulate, step, deferred.settings.loss_reduction, deferred.checks
        )
        self._deferred = deferred
        self._provisional = deferred.channel.zero()  # D from the first forward on (the fit's zero until then)
        self._factor: Tensor | None = None  # D/N, computed once, during the last backward

    def _count_of(self, entry: Entry) -> float:
        if entry.aliased:
            self.flag(Problem.ALIASED, f"the batch at position {entry.position} reuses the memory of a batch in flight")
        return 0.0

    def forward_done(self, micro: MicroBatch, output: StepOutput, batch: Any) -> Tensor:
        if output.aux_loss is not None:  # raised on every rank before the update; the backward runs without it
            self.flag(Problem.AUX_LOSS_DEFERRED)
        settings = self._deferred.settings
        count: Tensor | float = 0.0
        if not micro.filler:
            count = count_received(self, batch, output.num_items, settings.count_fn, settings.count_fn_given, True)
            if output.loss is None:
                self.flag(Problem.NO_LOSS)
        self.add(count, None if micro.filler else output.loss, micro.filler)
        if micro.position == self.start:
            self._provisional = self._deferred.provisional(count, self.accumulate)
        if micro.last:
            self.close()
            self._deferred.reducing = self
        # An empty micro-batch's mean is 0/0 = NaN and its scale 0. The backward of `loss * scale` multiplies the
        # incoming gradient by the scale and never reads the loss, so its gradient is exactly zero without a guard
        # (the forward value stays NaN, as under plain DDP).
        if not isinstance(count, Tensor):  # a filler
            return output.backprop * 0.0
        items = count if self.mean else (count > 0).to(count.dtype)
        return output.backprop * (items / self._provisional)

    def gradient_factor(self) -> Tensor:
        """D/N on the device, waiting for the exchange there (no host read)."""
        if self._factor is None:
            # D >= 1, so D/N is +inf exactly when N = 0: that window changes nothing
            self._factor = torch.nan_to_num(self._provisional / self.global_count(), posinf=0.0)
        return self._factor

    def end(self) -> Ended:
        """The final factor into the gradient, then the window's one host read."""
        self._deferred.gradient_final(self)
        reduced, local = self.read()
        global_count = reduced[Slot.COUNT]
        check_global_count(self, global_count, 1.0, lambda: self.where)
        self._deferred.next_provisional(global_count)
        return Ended(self.stats(reduced, local, global_count), reduced[Slot.MORE], reduced[Slot.END_UNREAD] > 0, None)
