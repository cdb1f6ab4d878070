"""The count check: is the count what the loss divides by? (docs/counts.md)

The strategies compute exactly the objective they are told, and the audit proves the applied gradient is its
gradient; both take the count on trust. This check tests it on every real micro-batch of a window. A micro-batch is
cut in two, S and its complement R, and the loss replayed without gradient on each. A loss that is the mean over the
count c satisfies

    c(S)·ℓ(S) + c(R)·ℓ(R) = c·ℓ        (a sum-reduced one: ℓ(S) + ℓ(R) = ℓ)

The cut is one both the loss and the count see: a random share of the valid labels (the others set to -100), so that
a shift the count does not know, a sum returned as a mean or a count of other items breaks the identity whatever
position the mistake lies at; or, where the loss does not read those labels or the count counts rows, a random share
of the rows. A cut whose halves the loss cannot tell apart, or that leaves a half the count finds empty and the
identity holding, decides nothing: the next cut, or the next micro-batch, decides. The whole micro-batch is replayed
too and compared with the loss it trained on: a step that draws randomness the replay cannot repeat is told apart
from a wrong count. Cost: three forwards per real micro-batch and rank (two more where the labels cannot decide),
without gradient, and one ``all_gather_object``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from token_mean import _counts
from token_mean._counts import IGNORE_INDEX, read_count

ROWS = ""
"""The cut of a row count: rows, not labels."""
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""The largest relative mismatch of a right count: the three losses sum the same per-item terms in other orders."""
SHARE = 0.382
"""The share of labels (rows) kept in S: far from 1/2 and 1/3, so that a few counted items the loss never sees are
not cut in proportion to the rest by chance."""
SEED = 0x5EED
"""Seeds the cuts: the same on every run and rank, drawn from a generator of their own (the run's are untouched)."""

Replay = Callable[[Any, int], Any]
"""(batch, index in the window) → the step's output (a loss, or a mapping), without gradient, leaving parameters,
buffers and RNG streams as they were."""


class Term(NamedTuple):
    """One term of the objective checked (a ``_settings.Term``'s fields)."""

    name: str | None  # None for an objective of one term
    count_fn: Any
    reduction: str


Outcome = Literal["passed", "failed", "undecided", "random", "error"]


@dataclass(frozen=True)
class Sample:
    """One micro-batch of the checked window: its batch, whether it is a filler, and the step's output as it trained
    (detached; None: replay the micro-batch twice instead)."""

    batch: Any
    filler: bool = False
    trained: Any = None


@dataclass(frozen=True)
class Verdict:
    """One rank's check of one term. ``failed``: the identity broke at micro-batch ``index`` (``mismatch`` >
    ``tolerance``), ``fixes`` the counts and reductions that satisfy it; ``random``: replaying the micro-batch gave
    another loss than it trained on; ``error``: a replay raised (``what`` says so); ``undecided``: no cut decided."""

    outcome: Outcome
    index: int = -1
    mismatch: float = 0.0
    tolerance: float = 0.0
    what: str = ""
    fixes: tuple[Fix, ...] = ()


@dataclass(frozen=True)
class Fix:
    """A count and reduction that satisfy the identity where the user's broke it (``term``: another term's count)."""

    count: str
    reduction: str
    term: str | None = None


@dataclass(frozen=True)
class Cut:
    """A micro-batch cut in two: the batch keeping S, the batch keeping R, and what S is."""

    keep: Any
    rest: Any
    what: str


class _ReplayFailed(Exception):
    pass


@dataclass
class Replays:
    """The replays of one rank's window, each run once and shared by the terms; ``matched``: every rank must run as
    many forwards (they are collectives: FSDP2, tensor parallelism), so :meth:`pad` tops them up."""

    replay: Replay
    samples: Sequence[Sample]
    matched: bool = False
    runs: int = 0
    drew: set[int] = field(default_factory=set)  # micro-batches whose replays drew from the global generators
    _done: dict[tuple[int, str], Any] = field(default_factory=dict)
    _cuts: dict[tuple[int, str], Cut | None] = field(default_factory=dict)

    def output(self, index: int, variant: str, batch: Any) -> Any:
        key = (index, variant)
        if key not in self._done:
            self.runs += 1
            try:
                self._done[key] = self.replay(batch, index)
            except Exception as error:  # the check ends in one outcome on every rank, never the run killed
                self._done[key] = _ReplayFailed(
                    f"replaying micro-batch {index} ({variant}) raised {type(error).__name__}: {error}"
                )
        done = self._done[key]
        if isinstance(done, _ReplayFailed):
            raise done
        return done

    def cut(self, index: int, key: str) -> Cut | None:
        if (index, key) not in self._cuts:
            batch = self.samples[index].batch
            self._cuts[index, key] = rows_cut(batch, index) if key == ROWS else labels_cut(batch, key, index)
        return self._cuts[index, key]

    def pad(self, forwards: int) -> None:
        """Matched: run forwards until ``forwards`` ran (their results unused, their failures too)."""
        if not self.matched or not self.samples:
            return
        while self.runs < forwards:
            self.runs += 1
            with contextlib.suppress(Exception):  # its failure, if any, was recorded where the checked replay raised
                self.replay(self.samples[0].batch, 0)


def forwards_per_sample(terms: Sequence[Term]) -> int:
    """The most forwards one micro-batch can take: the whole twice (once where the loss it trained on stands for the
    second, which a rank cannot know of another), a labels cut per term, a rows cut."""
    return 2 + 2 * len(terms) + 2


def labels_key(count_fn: Any, batch: Any) -> str | None:
    """The batch key of the labels ``count_fn`` counts (:data:`ROWS` for a row count, or for labels that are not
    class indices, whose -100 no loss ignores: regression targets, boolean masks), None for a count that cannot be
    checked (one per micro-batch). A count of your own counts ``labels`` unless it names another batch key in a
    ``labels_key`` attribute."""
    if count_fn is _counts.count_micro_batches:
        return None
    if count_fn is _counts.count_examples or count_fn is _counts.count_sequences:
        return ROWS
    named = getattr(count_fn, "labels_key", None)
    key = named if isinstance(named, str) and named else "labels"
    if count_fn is _counts.count_shifted_labels and isinstance(batch, Mapping):
        key = "shift_labels" if isinstance(batch.get("shift_labels"), Tensor) else key
    labels = batch.get(key) if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        return ROWS
    return key


def plan(count_fn: Any, batch: Any, batch_statistics: bool) -> list[str]:
    """The cuts to try, in order: the labels the count counts, then rows (not where BatchNorm normalizes over them)."""
    key = labels_key(count_fn, batch)
    keys = [] if key is None else [key] if key == ROWS else [key, ROWS]
    return [k for k in keys if not (k == ROWS and batch_statistics)]


def _generator(index: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + index)


def _share(n: int) -> int:
    return min(n - 1, max(1, round(n * SHARE)))


def labels_cut(batch: Any, key: str, index: int = 0) -> Cut | None:
    """S: a random share of the valid ``batch[key]`` (-100 elsewhere), R: the other valid labels; None with fewer
    than two valid labels."""
    labels = batch.get(key) if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor) or labels.dim() == 0:
        return None
    valid = labels != IGNORE_INDEX
    positions = valid.flatten().nonzero().squeeze(1)  # after the window: the host read is free
    if positions.numel() < 2:
        return None
    chosen = torch.randperm(positions.numel(), generator=_generator(index))[: _share(positions.numel())]
    kept = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
    kept[positions[chosen.to(positions.device)]] = True
    kept = kept.view_as(labels)
    what = f"{int(chosen.numel())} of the {positions.numel()} valid `{key}` drawn at random"
    return Cut(
        _with(batch, key, labels.masked_fill(~kept, IGNORE_INDEX)),
        _with(batch, key, labels.masked_fill(kept | ~valid, IGNORE_INDEX)),
        what,
    )


def rows_cut(batch: Any, index: int = 0) -> Cut | None:
    """S: a random share of the rows of every tensor as long as the batch's first, R: the other rows."""
    rows = _rows(batch)
    if rows is None or rows < 2:
        return None
    order = torch.randperm(rows, generator=_generator(index))
    chosen, rest = order[: _share(rows)].sort().values, order[_share(rows) :].sort().values
    what = f"{chosen.numel()} of its {rows} rows drawn at random"
    return Cut(_rows_of(batch, chosen, rows), _rows_of(batch, rest, rows), what)


def _with(batch: Any, key: str, labels: Tensor) -> Any:
    changed = copy.copy(batch)  # a dict, or a UserDict such as Hugging Face's BatchEncoding, with its own data
    changed[key] = labels
    return changed


def _rows(batch: Any) -> int | None:
    """The batch's rows: the leading dimension every tensor of it shares (None where they differ: sub-batches of
    several loaders, whose rows a cut could not keep together)."""
    found: set[int] = set()
    apply_to_collection(batch, Tensor, lambda tensor: found.add(tensor.shape[0]) if tensor.dim() else None)
    return found.pop() if len(found) == 1 else None


def _rows_of(batch: Any, rows: Tensor, length: int) -> Any:
    return apply_to_collection(
        batch, Tensor, lambda t: t.index_select(0, rows.to(t.device)) if t.dim() and t.shape[0] == length else t
    )


def term_of(output: Any, name: str | None) -> tuple[Tensor | None, Any]:
    """(the term's loss, the ``num_items`` reported with it) of a step's output."""
    if isinstance(output, Tensor):
        return (output, None) if name is None else (None, None)
    if not isinstance(output, Mapping):
        return None, None
    items = output.get("num_items")
    if name is None:
        return output.get("loss"), items
    return output.get(name), items.get(name) if isinstance(items, Mapping) else None


def check(
    replays: Replays, term: Term, num_items: bool, batch_statistics: bool = False, others: Sequence[Term] = ()
) -> Verdict:
    """This rank's verdict on ``term`` over its window's real micro-batches: the first that breaks the identity fails
    it (naming the counts that satisfy it on every micro-batch); once every micro-batch was tried, it passed if one
    decided. ``num_items``: a reported ``num_items`` is the count (deferred); ``others``: the other terms, whose
    counts are named if they satisfy this term's loss."""
    judging = _Judging(replays, Term(*term), num_items, batch_statistics)
    passed = False
    for index in range(len(replays.samples)):
        try:
            verdict = judging.sample(index)
            if verdict is not None and verdict.outcome == "failed":
                # a replay that repeats its draws by chance (a few tokens dropped alike) proves nothing where another
                # micro-batch's does not: randomness the replay cannot repeat makes the failed cut untrustworthy
                verdict = judging.unrepeatable_besides(index) or replace(verdict, fixes=judging.fixes(index, others))
        except _ReplayFailed as failure:
            return Verdict("error", index, what=str(failure))
        if verdict is not None and verdict.outcome != "passed":
            return verdict
        passed |= verdict is not None
    return Verdict("passed" if passed else "undecided")


@dataclass
class _Judging:
    """One term judged on one rank's micro-batches, through the replays they share with the other terms."""

    replays: Replays
    term: Term
    num_items: bool
    batch_statistics: bool

    def cuts(self, index: int, count_fn: Any) -> list[str]:
        sample = self.replays.samples[index]
        return [] if sample.filler else plan(count_fn, sample.batch, self.batch_statistics)

    def whole(self, index: int) -> tuple[Tensor | None, Any]:
        return term_of(self.replays.output(index, "whole", self.replays.samples[index].batch), self.term.name)

    def tolerance(self, index: int) -> float:
        loss = self.whole(index)[0]
        return TOLERANCE.get(loss.dtype if isinstance(loss, Tensor) else torch.float32, 2e-5)

    def judged(self, index: int, key: str, count_fn: Any, reduction: str, tolerance: float) -> tuple[float, str] | None:
        """The cut ``key`` of micro-batch ``index``, replayed (each half once, whatever the terms) and judged with
        ``count_fn`` and ``reduction``: (its mismatch, what S is), or None where it decides nothing. A rows cut draws
        other random numbers than the whole (dropout's masks follow the batch's shape): it is not trusted where the
        micro-batch's replays draw from the global generators. A labels cut keeps every input."""
        whole = self.whole(index)  # replayed first: the draws are known
        if key == ROWS and index in self.replays.drew:
            return None
        cut = self.replays.cut(index, key)
        if cut is None:
            return None
        halves = [
            term_of(self.replays.output(index, f"{key or 'rows'} {half}", part), self.term.name)
            for half, part in (("S", cut.keep), ("R", cut.rest))
        ]
        outputs = [whole, *halves]
        parts = (self.replays.samples[index].batch, cut.keep, cut.rest)
        own = self.num_items and count_fn is self.term.count_fn  # deferred: the step's reported count is its count
        counts = [_count(count_fn, part, items, own) for part, (_, items) in zip(parts, outputs, strict=True)]
        mismatch = judge(counts, [_float(loss) for loss, _ in outputs], reduction, tolerance)
        return None if mismatch is None else (mismatch, cut.what)

    def sample(self, index: int) -> Verdict | None:
        """Micro-batch ``index``: failed (its fixes not named yet), random, passed, or None (no cut decided)."""
        _, count_fn, reduction = self.term
        cuts = self._checkable(index)
        if not cuts:
            return None
        unrepeatable = self._unrepeatable(index)
        if unrepeatable is not None:
            return unrepeatable
        tolerance = self.tolerance(index)
        for key in cuts:
            judged = self.judged(index, key, count_fn, reduction, tolerance)
            if judged is not None:
                mismatch, what = judged
                outcome: Outcome = "passed" if mismatch <= tolerance else "failed"
                return Verdict(outcome, index, mismatch, tolerance, what)
        return None

    def _checkable(self, index: int) -> list[str]:
        """The cuts of micro-batch ``index``, none where it has no item (its loss is 0/0) or too few labels (rows)
        to cut: the other micro-batches decide."""
        count_fn, sample = self.term.count_fn, self.replays.samples[index]
        if not self.num_items and not sample.filler and _count(count_fn, sample.batch, None, False) <= 0:
            return []
        cuts = self.cuts(index, count_fn)
        return cuts if cuts and self.replays.cut(index, cuts[0]) is not None else []

    def _unrepeatable(self, index: int) -> Verdict | None:
        """A "random" verdict where micro-batch ``index`` (one with cuts) replayed whole gives another loss than it
        trained on (or than a first replay gave): randomness the replay cannot repeat."""
        sample = self.replays.samples[index]
        loss, tolerance = self.whole(index)[0], self.tolerance(index)
        again = sample.trained if sample.trained is not None else self.replays.output(index, "again", sample.batch)
        reference = term_of(again, self.term.name)[0]
        if _same(loss, reference, tolerance):
            return None
        what = "trained on" if sample.trained is not None else "gave the first time"
        return Verdict("random", index, what=f"{_value(loss)} replayed, {_value(reference)} {what}")

    def unrepeatable_besides(self, failed: int) -> Verdict | None:
        """The first other micro-batch with cuts whose whole replay shows randomness the replay cannot repeat (its
        replays are within :func:`forwards_per_sample`), else None."""
        others = (i for i in range(len(self.replays.samples)) if i != failed and self._checkable(i))
        return next(filter(None, map(self._unrepeatable, others)), None)

    def fixes(self, failed: int, others: Sequence[Term]) -> tuple[Fix, ...]:
        """The counts and reductions that satisfy the identity on every cut that decides, first of micro-batch
        ``failed`` (its rows cut replayed too: a mean of per-row means is a row count's loss), then of the others:
        on the failure path only, within :func:`forwards_per_sample`."""
        name, count_fn, reduction = self.term
        other = "sum" if reduction == "mean" else "mean"
        candidates: list[tuple[Any, str, Fix]] = [
            *((c, reduction, Fix(c.__name__, reduction)) for c in _NAMED if c is not count_fn),
            *((c, r, Fix(_name(c), r, n)) for n, c, r in others if n != name and c is not count_fn),
            (count_fn, other, Fix(_name(count_fn), other)),
        ]
        order = [failed, *(i for i in range(len(self.replays.samples)) if i != failed)]
        scored = {fix: self._satisfies(candidate, r, order) for candidate, r, fix in candidates}
        best = max(scored.values(), default=0)
        # a count that held on more cuts is named alone: a row count may hold where rows carry even counts
        return tuple(fix for fix, score in scored.items() if score and score == best)

    def _satisfies(self, count_fn: Any, reduction: str, order: Sequence[int]) -> int:
        """How many cuts that decide, in ``order`` of the micro-batches the term's own count checks, hold the
        identity with ``count_fn`` and ``reduction``; 0 if one breaks it (or none decides)."""
        decided = 0
        for index in order:
            if not self.cuts(index, self.term.count_fn):
                continue
            tolerance = self.tolerance(index)
            for key in self.cuts(index, count_fn):
                judged = self.judged(index, key, count_fn, reduction, tolerance)
                if judged is None:
                    continue
                if judged[0] > tolerance:
                    return 0
                decided += 1
        return decided


def judge(counts: Sequence[float], losses: Sequence[float], reduction: str, tolerance: float) -> float | None:
    """|c(S)·ℓ(S) + c(R)·ℓ(R) − c·ℓ| relative to the terms (sum: without the counts); a half without items adds
    nothing. None, not decisive, where the loss does not tell the halves from the whole, or where a half the count
    finds empty leaves the identity holding (it might hold because the loss never sees that half either)."""
    whole, keep, rest = losses
    if counts[0] <= 0 or (_close(keep, whole, tolerance) and _close(rest, whole, tolerance)):
        return None
    terms = [
        (count if reduction == "mean" else 1.0) * loss if count > 0 else 0.0
        for count, loss in zip(counts, losses, strict=True)
    ]
    if not all(math.isfinite(t) for t in terms):
        return math.inf
    scale = sum(abs(t) for t in terms)
    mismatch = abs(terms[1] + terms[2] - terms[0]) / scale if scale > 0 else 0.0
    empty_half = counts[1] <= 0 or counts[2] <= 0
    return None if empty_half and mismatch <= tolerance else mismatch


_NAMED = (_counts.count_valid_labels, _counts.count_shifted_labels, _counts.count_sequences, _counts.count_examples)


def _count(count_fn: Any, batch: Any, reported: Any, num_items: bool) -> float:
    if num_items and reported is not None:
        return float(reported)
    return read_count(count_fn, batch)[0]


def _float(loss: Any) -> float:
    return math.nan if not isinstance(loss, Tensor) else float(loss.detach().double())


def _value(loss: Any) -> str:
    return "no loss" if not isinstance(loss, Tensor) else f"{_float(loss):.6g}"


def _close(a: float, b: float, tolerance: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isnan(a) == math.isnan(b) and (math.isnan(a) or a == b)
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def _same(loss: Any, reference: Any, tolerance: float) -> bool:
    if not isinstance(loss, Tensor) or not isinstance(reference, Tensor):
        return isinstance(loss, Tensor) == isinstance(reference, Tensor)
    return _close(_float(loss), _float(reference), tolerance)


def _name(count_fn: Any) -> str:
    return getattr(count_fn, "__name__", None) or type(count_fn).__name__


def describe(count_fn: Any, name: str | None = None) -> str:
    where = "" if name is None else f"[{name!r}]"
    if count_fn is _counts.count_valid_labels and name is None:
        return "`count_fn=count_valid_labels` (the default)"
    return f"`count_fn{where}={_name(count_fn)}`"


_WHY = {
    "count_shifted_labels": " (the loss never predicts a row's first label: its labels are shifted, in the step or"
    " inside the model)",
    "count_valid_labels": " (the loss scores every valid label as it lies: labels aligned with the logits)",
    "count_examples": " (a mean over the micro-batch's rows)",
    "count_sequences": " (a mean over sequences with a valid label: a mean of per-row means, say)",
}


def _fix_text(fix: Fix, term: Term, step: str) -> str:
    name, count_fn, reduction = term
    key = "" if name is None else f"[{name!r}]"
    if fix.count == _name(count_fn) and fix.reduction != reduction and fix.term is None:
        returns = "a sum" if fix.reduction == "sum" else "a mean over the count"
        return f"`loss_reduction{key}='{fix.reduction}'` ({step} returns {returns})"
    if fix.term is not None:
        return f"`count_fn{key}={fix.count}`, the count of term {fix.term!r}"
    return f"`count_fn{key}=token_mean.{fix.count}`" + _WHY.get(fix.count, "")


def _swapped(terms: Sequence[Term], verdicts: Sequence[Verdict | None]) -> str | None:
    """Two failed terms each satisfied by the other's count: their counts are swapped."""
    for (a, count_a, _), verdict_a in zip(terms, verdicts, strict=True):
        for (b, count_b, _), verdict_b in zip(terms, verdicts, strict=True):
            if a is None or b is None or verdict_a is None or verdict_b is None or a >= b:
                continue
            if any(f.term == b for f in verdict_a.fixes) and any(f.term == a for f in verdict_b.fixes):
                return (
                    f"the counts of {a!r} and {b!r} are swapped: `count_fn={{{a!r}: {_name(count_b)}, {b!r}:"
                    f" {_name(count_a)}, ...}}` satisfies both"
                )
    return None


def decide(
    gathered: Sequence[Sequence[Verdict]], terms: Sequence[Term], where: str, step: str
) -> tuple[float | None, str | None, list[str]]:
    """Every rank's verdicts (one per term, in ``terms``' order) → (the largest mismatch measured, None if nothing
    decided; the error every rank raises, or None; the warnings, alike on every rank)."""
    mismatches = [v.mismatch for verdicts in gathered for v in verdicts if v.outcome in ("passed", "failed")]
    largest = max(mismatches, default=None)
    # randomness the replay cannot repeat, seen on any rank, makes another rank's failed cut of the term untrustworthy
    failed = [None if _first(gathered, t, "random") else _first(gathered, t, "failed") for t in range(len(terms))]
    swap = _swapped(terms, [None if f is None else f[1] for f in failed])
    for term, found in zip(terms, failed, strict=True):
        if found is not None:
            return largest, _failure(term, *found, where, step, swap), []
    for outcome in ("random", "error"):
        for t, term in enumerate(terms):
            found = _first(gathered, t, outcome)
            if found is not None:
                return largest, None, [_undecided(term, *found, where, step)]
    warnings = []
    for t, (name, count_fn, _) in enumerate(terms):
        if all(verdicts[t].outcome == "undecided" for verdicts in gathered) and labels_key(count_fn, {}) is not None:
            warnings.append(
                f"token_mean: the count check could not check {describe(count_fn, name)} at {where}: no real"
                " micro-batch on any rank held two valid labels of class indices under the key the count counts"
                " (`labels`, or the count's `labels_key` attribute) nor two rows whose halves the loss tells apart."
                " Nothing says the count is the loss's own denominator. To make it checkable, name the labels the"
                " loss reads in the count's `labels_key` attribute (`my_count.labels_key = 'targets'`); pass"
                " `check_count=False` to silence this."
            )
    return largest, None, warnings


def _first(gathered: Sequence[Sequence[Verdict]], term: int, outcome: str) -> tuple[int, Verdict] | None:
    return next(((rank, v[term]) for rank, v in enumerate(gathered) if v[term].outcome == outcome), None)


def _failure(term: Term, rank: int, verdict: Verdict, where: str, step: str, swap: str | None) -> str:
    name, count_fn, reduction = term
    at = where if name is None else f"{where}, term {name!r}"
    figure = (
        "a part the count says holds items has no finite loss"
        if math.isinf(verdict.mismatch)
        else f"relative mismatch {verdict.mismatch:.1e} > {verdict.tolerance:.0e}"
    )
    text = (
        f"token_mean: the count check failed at {at}: the loss is not a {reduction} over {describe(count_fn, name)}"
        f" ({figure}; rank {rank}, micro-batch {verdict.index} of the window), so every update would follow another"
        " objective than the one written down, silently."
        f"\n  How: {verdict.what} kept, then the rest, and {step} replayed on each without gradient; with the"
        " loss's own denominator c, c(S)·loss(S) + c(rest)·loss(rest) = c·loss (a sum: loss(S) + loss(rest) = loss)."
    )
    if swap is not None:
        return text + f"\n  Fix: {swap}."
    if verdict.fixes:
        return text + "\n  Fix: " + "; or ".join(_fix_text(f, term, step) for f in verdict.fixes) + " satisfies it."
    return text + (
        "\n  Fix: none of the named counts and reductions satisfies it. A loss that shifts its labels by another"
        " offset (a multi-token-prediction head: `labels[..., 2:]`) takes a count of exactly the labels it scores,"
        " `lambda batch: (batch['labels'][..., 2:] != -100).sum()`; a loss that weighs classes"
        " (`F.cross_entropy(weight=w)`) takes `count_fn=token_mean.ClassWeightedCount(w)`; a loss over a mask the"
        f" model decides takes `mode='deferred'` with `{{'loss': ..., 'num_items': ...}}` returned by {step};"
        " if the count is right and the loss does not split this way, pass `check_count=False`."
    )


def _undecided(term: Term, rank: int, verdict: Verdict, where: str, step: str) -> str:
    name, count_fn, _ = term
    at = where if name is None else f"{where}, term {name!r}"
    if verdict.outcome == "random":
        cause = (
            f"replaying micro-batch {verdict.index} on rank {rank} did not give the loss it trained on"
            f" ({verdict.what}): {step} draws randomness the replay cannot repeat (only torch's global generators"
            " are replayed; Python's `random`, numpy and a `torch.Generator` of its own are not)"
        )
        fix = "draw that randomness from torch's global generator"
    else:
        cause = (
            f"{verdict.what} on rank {rank}; {step} must accept a micro-batch with any share of its labels set"
            " to -100 (or any share of its rows)"
        )
        fix = "let the step accept such a micro-batch"
    return (
        f"token_mean: the count check could not decide at {at}: {cause}. {describe(count_fn, name)} was not checked:"
        f" to check it, {fix}; pass `check_count=False` to silence this."
    )
