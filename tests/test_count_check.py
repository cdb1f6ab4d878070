"""The count check (docs/counts.md): before the first update, every rank refuses a count that is not the loss's own
denominator, naming the fix first; setups whose count is right are never flagged, and train the same parameters with
the check on and off; a step the replay cannot repeat (its own randomness, a failing replay) ends in one warning on
every rank, never in a refusal that blames the count or in a killed run.

Three layers: the check itself in one process over simulated ranks (every case, both data layouts); the two front
ends in one process (the Trainer's `training_step`, Fabric's `loss_fn`); forked processes only where every rank's
outcome, a real collective or FSDP2's matched forwards are what is tested.

Every loss here is written in plain torch; the references import nothing from the package.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness
import pytest
import torch
import torch.nn.functional as F
from _harness import CLASSES, EXACT, HIDDEN, IGNORE_INDEX, MODES, Batch, TokenModule, TokenNet, fit, strategy_for
from _mesh import MeshModule
from _ranks import raises_everywhere
from torch import Tensor, nn

from token_mean import ClassWeightedCount, DenominatorError, count_examples, count_sequences, count_shifted_labels
from token_mean._audit import Objective, Recorded, capture_rng, forward_only
from token_mean._count_check import (
    ROWS,
    Replays,
    Sample,
    Term,
    Verdict,
    check,
    decide,
    labels_cut,
    labels_key,
    plan,
    rows_cut,
)
from token_mean._counts import count_valid_labels

K = 2
WEIGHT = torch.tensor([0.2, 3.0, 1.0, 0.5, 2.0, 0.05, 1.5], dtype=torch.float64)
Loss = Callable[[nn.Module, Batch], Any]
Data = list[list[Batch]]


# ---------------------------------------------------------------------------------------------------------------
# losses as users write them, and data
# ---------------------------------------------------------------------------------------------------------------


def ce(net: nn.Module, batch: Batch, reduction: str = "mean", **kwargs: Any) -> Tensor:
    logits = net(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction, **kwargs)


def shifted(net: nn.Module, batch: Batch, reduction: str = "mean", by: int = 1) -> Tensor:
    """The shift a user writes in `training_step`: position t scores label t + `by`."""
    logits = net(batch["x"])[:, :-by]
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, by:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def chunked_shifted(net: nn.Module, batch: Batch) -> Tensor:
    """LitGPT's `chunked_cross_entropy` over shifted logits: a mean whose denominator is clamped to 1."""
    logits, labels = net(batch["x"])[:, :-1], batch["labels"][:, 1:]
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def z_loss(net: nn.Module, batch: Batch) -> Tensor:
    """Cross-entropy plus a z-loss, both means over the valid labels."""
    logits = net(batch["x"])
    valid = batch["labels"] != IGNORE_INDEX
    z = torch.logsumexp(logits, -1).square()
    return ce(net, batch) + 1e-2 * (z * valid).sum() / valid.sum().clamp(min=1)


def router(net: nn.Module, batch: Batch) -> Tensor:
    """Cross-entropy plus a term that does not depend on the labels (a router balancing loss inside `.loss`)."""
    return ce(net, batch) + 0.1 * net(batch["x"]).mean().square()


def row_weighted(net: nn.Module, batch: Batch) -> Tensor:
    """Each row's tokens weighted by a weight of the row, the sum divided by the valid labels."""
    per_token = F.cross_entropy(net(batch["x"]).transpose(1, 2), batch["labels"], ignore_index=IGNORE_INDEX,
                                reduction="none")
    weights = 1.0 + torch.arange(per_token.shape[0], dtype=per_token.dtype)[:, None] / 4
    return (weights * per_token).sum() / (batch["labels"] != IGNORE_INDEX).sum()


def row_sums_mean(net: nn.Module, batch: Batch) -> Tensor:
    """A mean over the rows of each row's summed token loss (count_examples)."""
    per_token = F.cross_entropy(net(batch["x"]).transpose(1, 2), batch["labels"], ignore_index=IGNORE_INDEX,
                                reduction="none")
    return per_token.sum(1).mean()


def row_means(net: nn.Module, batch: Batch) -> Tensor:
    """A mean over the rows with a valid label of each row's mean token loss (a sequence mean)."""
    per_token = F.cross_entropy(net(batch["x"]).transpose(1, 2), batch["labels"], ignore_index=IGNORE_INDEX,
                                reduction="none")
    valid = batch["labels"] != IGNORE_INDEX
    kept = valid.any(1)
    return (per_token.sum(1)[kept] / valid.sum(1)[kept]).mean()


def model_mask(net: nn.Module, batch: Batch) -> Tensor:
    """A mean over the valid labels the model itself keeps (its logits decide): not the labels' count."""
    logits = net(batch["x"])
    kept = (batch["labels"] != IGNORE_INDEX) & (logits[..., 0] > logits[..., 1])
    labels = batch["labels"].masked_fill(~kept, IGNORE_INDEX)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def masked_with_items(net: nn.Module, batch: Batch) -> dict[str, Tensor]:
    logits = net(batch["x"])
    kept = (batch["labels"] != IGNORE_INDEX) & (logits[..., 0] > logits[..., 1])
    labels = batch["labels"].masked_fill(~kept, IGNORE_INDEX)
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return {"loss": total / kept.sum().clamp(min=1), "num_items": kept.sum()}


def python_random(net: nn.Module, batch: Batch) -> Tensor:
    """Cross-entropy with a token dropout drawn from Python's `random`, which the replay cannot repeat."""
    labels = batch["labels"].clone()
    for position in range(labels.numel()):
        if random.random() < 0.3:
            labels.view(-1)[position] = IGNORE_INDEX
    return ce(net, {**batch, "labels": labels})


class OwnGenerator(TokenNet):
    """A dropout drawn from a `torch.Generator` the module holds: not one of torch's global generators."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.hidden(x))
        keep = torch.rand(hidden.shape, generator=self.generator) > 0.3
        return self.out(hidden * keep / 0.7)


class DropoutNet(TokenNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.dropout(torch.tanh(self.hidden(x)), 0.3, self.training))


class BatchNormNet(TokenNet):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(HIDDEN, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.norm(self.hidden(x).transpose(1, 2)).transpose(1, 2)))


def attention_mask_count(batch: Batch) -> Tensor:
    return batch["attention_mask"].sum()


def named_attention_mask_count(batch: Batch) -> Tensor:
    return batch["attention_mask"].sum()


named_attention_mask_count.labels_key = "labels"  # type: ignore[attr-defined]


def count_after_two(batch: Batch) -> Tensor:
    """The right count of a loss shifted by 2: a user's own, checked on `labels`."""
    return (batch["labels"][:, 2:] != IGNORE_INDEX).sum()


def ragged(seed: int = 5) -> Data:
    """Ragged batches whose first label of a row is often valid (a shift the count does not know matters)."""
    return _harness.ragged_batches(2, 4, seed=seed, keep=(0.9, 0.6))


def long_rows(seed: int = 7) -> Data:
    """Ragged batches of rows of at least 4 positions (a loss shifted by 2 has targets)."""
    data = _harness.ragged_batches(2, 4, seed=seed, keep=(0.9, 0.7))
    return [[{k: v.repeat(1, 2, *([1] * (v.dim() - 2))) for k, v in b.items()} for b in rank] for rank in data]


def prompt_masked(seed: int = 11, tell: tuple[int, int] | None = (1, 1)) -> Data:
    """Prompt-masked rows (the first two labels never valid), except one row of micro-batch `tell` = (rank, index)
    whose first label is valid (pretraining text mixed in): the only place a shift the count does not know shows."""
    data = _harness.ragged_batches(2, 4, seed=seed, keep=(0.9, 0.8))
    data = [[{k: v.repeat(1, 2, *([1] * (v.dim() - 2))) for k, v in b.items()} for b in rank] for rank in data]
    for rank in data:
        for batch in rank:
            batch["labels"][:, :2] = IGNORE_INDEX
    if tell is not None:
        rank, index = tell
        data[rank][index]["labels"][0, 0] = 3
    return data


def with_attention_mask(data: Data) -> Data:
    return [[{**b, "attention_mask": torch.ones_like(b["labels"])} for b in rank] for rank in data]


def with_classes(data: Data, seed: int = 0) -> Data:
    generator = torch.Generator().manual_seed(seed)
    return [[{**b, "cls": torch.randint(0, CLASSES, (b["x"].shape[0],), generator=generator)} for b in rank]
            for rank in data]


def with_empty_first(data: Data) -> Data:
    return [[_harness.empty_like(rank[0]), *rank[1:]] for rank in data]


def packed(seed: int = 6) -> Data:
    """One packed row per micro-batch (several documents, one sequence)."""
    return [[{"x": b["x"].reshape(1, -1, b["x"].shape[-1]), "labels": b["labels"].reshape(1, -1)} for b in rank]
            for rank in ragged(seed)]


def cls_loss(net: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(net(batch["x"]).mean(1), batch["cls"])


def lm_and_cls(net: nn.Module, batch: Batch) -> dict[str, Tensor]:
    return {"lm": shifted(net, batch), "cls": cls_loss(net, batch)}


def two_heads(net: nn.Module, batch: Batch) -> dict[str, Tensor]:
    """Next-token and a multi-token-prediction head shifted by 2."""
    return {"ntp": shifted(net, batch), "mtp": shifted(net, batch, by=2)}


# ---------------------------------------------------------------------------------------------------------------
# the check in one process, over simulated ranks
# ---------------------------------------------------------------------------------------------------------------


def checked(
    data: Data,
    loss: Loss,
    count_fn: Any = count_valid_labels,
    reduction: str = "mean",
    net: type[TokenNet] = TokenNet,
    terms: Sequence[tuple[str | None, Any, str]] = (),
    num_items: bool = False,
    trained: bool = True,
) -> tuple[str | None, list[str], list[int]]:
    """The check of each rank's first K micro-batches, ranks simulated in one process (their verdicts gathered as
    `all_gather_object` would): (the error, the warnings, the forwards each rank replayed)."""
    torch.manual_seed(0)
    module = net()
    module.load_state_dict(_harness.initial_state(), strict=False)
    terms = list(terms) or [(None, count_fn, reduction)]
    batch_statistics = any(isinstance(m, nn.BatchNorm1d) for m in module.modules())
    gathered, forwards = [], []
    for rank_batches in data:
        recorded = []
        for index, batch in enumerate(rank_batches[:K]):
            rng = capture_rng()
            output = loss(module, batch) if trained else None
            losses = output.detach() if isinstance(output, Tensor) else output
            recorded.append(Recorded(batch, rng, False, index, losses if trained else None))
        objective = Objective(lambda m, r: loss(m, r.batch), count_fn, reduction)

        replays = Replays(lambda batch, index: None, [Sample(r.batch, r.filler, r.trained) for r in recorded])

        def replay(batch: Any, index: int, recorded: list[Recorded] = recorded, objective: Objective = objective,
                   replays: Replays = replays) -> Any:
            drew: list[bool] = []
            output = forward_only(module, objective.loss_fn, Recorded(batch, recorded[index].rng), objective.context,
                                  drew)
            if any(drew):
                replays.drew.add(index)
            return output

        replays.replay = replay
        gathered.append([check(replays, term, num_items, batch_statistics, terms) for term in terms])
        forwards.append(replays.runs)
    _, error, warnings = decide(gathered, terms, "window 0", "`training_step`")
    return error, warnings, forwards


# case: (data, loss, settings)
RIGHT: dict[str, tuple[Callable[[], Data], Loss, dict[str, Any]]] = {
    "cross-entropy": (ragged, ce, {}),
    "cross-entropy-prompt-masked": (prompt_masked, ce, {}),
    "label-smoothing": (ragged, lambda net, b: ce(net, b, label_smoothing=0.1), {}),
    "z-loss": (ragged, z_loss, {}),
    "router-loss": (ragged, router, {}),
    "row-weighted": (ragged, row_weighted, {}),
    "dropout": (ragged, ce, {"net": DropoutNet}),
    "batchnorm": (ragged, ce, {"net": BatchNormNet}),
    "class-weighted": (ragged, lambda net, b: ce(net, b, weight=WEIGHT), {"count_fn": ClassWeightedCount(WEIGHT)}),
    "shifted": (ragged, shifted, {"count_fn": count_shifted_labels}),
    "shifted-prompt-masked": (prompt_masked, shifted, {"count_fn": count_shifted_labels}),
    "chunked-shifted": (ragged, chunked_shifted, {"count_fn": count_shifted_labels}),
    "packed-shifted": (packed, shifted, {"count_fn": count_shifted_labels}),
    "shifted-by-2-own-count": (long_rows, lambda net, b: shifted(net, b, by=2), {"count_fn": count_after_two}),
    "sum": (ragged, lambda net, b: ce(net, b, "sum"), {"reduction": "sum"}),
    "empty-micro-batch": (lambda: with_empty_first(ragged()), ce, {}),
    "examples": (ragged, row_sums_mean, {"count_fn": count_examples}),
    "sequences": (ragged, row_means, {"count_fn": count_sequences}),
    "hugging-face-dict": (ragged, lambda net, b: {"loss": shifted(net, b), "logits": net(b["x"])},
                          {"count_fn": count_shifted_labels}),
    "deferred-num-items": (ragged, masked_with_items, {"num_items": True}),
    "two-terms": (lambda: with_classes(ragged()), lm_and_cls,
                  {"terms": [("lm", count_shifted_labels, "mean"), ("cls", count_examples, "mean")]}),
}


@pytest.mark.parametrize("case", list(RIGHT))
def test_a_right_count_is_never_flagged(case: str) -> None:
    make_data, loss, settings = RIGHT[case]
    for trained in (True, False):
        error, warnings, forwards = checked(make_data(), loss, trained=trained, **settings)
        assert error is None, error
        assert warnings == [], warnings
        assert sum(forwards) > 0, forwards


# case: (data, loss, settings, the fix the message names first)
WRONG: dict[str, tuple[Callable[[], Data], Loss, dict[str, Any], str]] = {
    # #41 item 1: the first position decided nothing, a shift's loss never reads it
    "chunked-shifted-mean-declared-sum": (ragged, chunked_shifted, {"count_fn": count_shifted_labels,
                                          "reduction": "sum"}, "Fix: `loss_reduction='mean'`"),
    "shifted-by-2-counted-shifted": (long_rows, lambda net, b: shifted(net, b, by=2),
                                     {"count_fn": count_shifted_labels}, "Fix: none of the named counts"),
    "attention-mask-count-named": (lambda: with_attention_mask(ragged()), ce, {"count_fn": named_attention_mask_count},
                                   "Fix: `count_fn=token_mean.count_valid_labels`"),
    # #41 item 2: only rank 1's second micro-batch holds a valid first label
    "shift-prompt-masked-later-micro-batch": (prompt_masked, shifted, {},
                                              "Fix: `count_fn=token_mean.count_shifted_labels`"),
    # #41 item 3: a count the user writes, without `labels_key`
    "attention-mask-count": (lambda: with_attention_mask(ragged()), ce, {"count_fn": attention_mask_count},
                             "Fix: `count_fn=token_mean.count_valid_labels`"),
    # #41 item 7: refusals that named no fix
    "mean-of-row-means-counted-with-tokens": (ragged, row_means, {}, "Fix: `count_fn=token_mean.count_sequences`"),
    "swapped-terms": (lambda: with_classes(ragged()), lm_and_cls,
                      {"terms": [("lm", count_examples, "mean"), ("cls", count_shifted_labels, "mean")]},
                      "Fix: the counts of 'cls' and 'lm' are swapped"),
    "mtp-term-counted-shifted": (long_rows, two_heads,
                                 {"terms": [("ntp", count_shifted_labels, "mean"), ("mtp", count_shifted_labels,
                                                                                      "mean")]},
                                 "term 'mtp'"),
    "shift-with-the-default-count": (ragged, shifted, {}, "Fix: `count_fn=token_mean.count_shifted_labels`"),
    "sum-as-mean": (ragged, lambda net, b: ce(net, b, "sum"), {}, "Fix: `loss_reduction='sum'`"),
    "mean-as-sum": (ragged, ce, {"reduction": "sum"}, "Fix: `loss_reduction='mean'`"),
    "class-weights-with-the-default-count": (ragged, lambda net, b: ce(net, b, weight=WEIGHT), {},
                                             "`count_fn=token_mean.ClassWeightedCount(w)`"),
    "a-mask-the-model-decides": (ragged, model_mask, {}, "`mode='deferred'` with `{'loss': ..., 'num_items': ...}`"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_count_is_refused_naming_the_fix_first(case: str) -> None:
    make_data, loss, settings, fix = WRONG[case]
    for trained in (True, False):
        error, _, _ = checked(make_data(), loss, trained=trained, **settings)
        assert error is not None and error.startswith("token_mean: the count check failed at window 0"), error
        assert fix in error, error
        if fix.startswith("Fix: `"):  # named first
            assert error.split("\n  Fix: ")[1].startswith(fix.removeprefix("Fix: ")), error


def test_the_outcome_does_not_depend_on_which_rows_came_first() -> None:
    """#41 item 2: wherever the one tell-tale row lies (any rank, any micro-batch), the shift is refused; with no
    such row the two counts agree and the default count is right."""
    for tell in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        error, _, _ = checked(prompt_masked(tell=tell), shifted)
        assert error is not None and f"micro-batch {tell[1]}" in error and f"rank {tell[0]}" in error, (tell, error)
    error, warnings, _ = checked(prompt_masked(tell=None), shifted)
    assert error is None and warnings == []


def test_a_replay_it_cannot_repeat_is_not_blamed_on_the_count() -> None:
    """#41 item 6: randomness the replay does not restore (Python's `random`, a generator the module holds) is told
    apart from a wrong count: a warning that says so, no refusal."""
    for loss, net in [(python_random, TokenNet), (ce, OwnGenerator)]:
        error, warnings, _ = checked(ragged(), loss, net=net)
        assert error is None, error
        assert len(warnings) == 1 and "randomness the replay cannot repeat" in warnings[0], warnings
        assert "`check_count=False`" in warnings[0] and "not a mean" not in warnings[0]
    error, warnings, _ = checked(ragged(), python_random, trained=False)  # the whole replayed twice instead
    assert error is None and "randomness" in warnings[0]


def test_a_micro_batch_that_repeats_by_chance_is_not_blamed_on_the_count() -> None:
    """A token dropout from Python's `random` can drop the same tokens again when one micro-batch is replayed whole
    (few valid tokens): its cut then fails, but the other micro-batches show the randomness, and a rank that saw it
    outweighs another rank's failed cut. (It failed about one run in ten with an unseeded `random`.)"""
    calls = 0

    def clean_until_first_cut(net: nn.Module, batch: Batch) -> Tensor:
        """Rank 0's four training forwards and its whole replay of micro-batch 0 drop nothing; every later call
        drops tokens, seeded by the call (so the run is the same every time)."""
        nonlocal calls
        calls += 1
        if calls <= K + 1:
            return ce(net, batch)
        draw = random.Random(calls)
        labels = batch["labels"].clone()
        for position in range(labels.numel()):
            if draw.random() < 0.3:
                labels.view(-1)[position] = IGNORE_INDEX
        return ce(net, {**batch, "labels": labels})

    error, warnings, _ = checked(ragged(), clean_until_first_cut)
    assert error is None, error
    assert len(warnings) == 1 and "randomness the replay cannot repeat" in warnings[0], warnings

    terms = [Term(None, count_valid_labels, "mean")]
    failed = Verdict("failed", 0, 0.5, 1e-5, "3 of the 6 valid `labels` drawn at random")
    random_ = Verdict("random", 2, what="2.5 replayed, 2.25 trained on")
    for gathered in ([[failed], [random_]], [[random_], [failed]]):
        _, error, warnings = decide(gathered, terms, "window 0", "`training_step`")
        assert error is None and len(warnings) == 1 and "randomness" in warnings[0], (error, warnings)
    _, error, _ = decide([[failed], [Verdict("passed", 1, 0.0, 1e-5)]], terms, "window 0", "`training_step`")
    assert error is not None and "the count check failed" in error


def test_a_failing_replay_ends_in_a_warning() -> None:
    """#41 item 5: a step that raises on a replayed half is skipped with a warning naming what failed."""

    def picky(net: nn.Module, batch: Batch) -> Tensor:
        if not torch.is_grad_enabled():  # the replays run without gradient
            raise ValueError("cannot reshape tensor of 0 elements")
        return ce(net, batch)

    error, warnings, _ = checked(ragged(), picky)
    assert error is None, error
    assert len(warnings) == 1 and "raised ValueError: cannot reshape tensor of 0 elements" in warnings[0], warnings
    assert "`check_count=False`" in warnings[0]


def test_dropout_never_decides_a_rows_cut() -> None:
    """Dropout draws its masks by the batch's shape: a rows cut of a step that draws from the global generators
    decides nothing (a labels cut keeps every input, and decides); with a row count nothing else can decide."""
    one_label = [[{**b, "labels": torch.full_like(b["labels"], IGNORE_INDEX).index_fill(1, torch.tensor([0]), 1)}
                  for b in rank] for rank in ragged()]
    error, warnings, _ = checked(one_label, ce, net=DropoutNet)  # one label per row: the rows would decide
    assert error is None and len(warnings) <= 1, (error, warnings)
    error, warnings, _ = checked(ragged(), row_sums_mean, count_fn=count_examples, net=DropoutNet)
    assert error is None and len(warnings) == 1 and "could not check `count_fn=count_examples`" in warnings[0]
    error, _, _ = checked(ragged(), shifted, net=DropoutNet)  # a labels cut still decides under dropout
    assert error is not None and "Fix: `count_fn=token_mean.count_shifted_labels`" in error


def test_nothing_to_cut_warns_once() -> None:
    """One valid label and one row per micro-batch: nothing decides, and a warning says so and how to make it
    checkable."""
    data = [[{"x": b["x"][:1], "labels": torch.full_like(b["labels"][:1], IGNORE_INDEX).index_fill(1, torch.tensor(
        [0]), 2)} for b in rank] for rank in ragged()]
    error, warnings, _ = checked(data, ce)
    assert error is None
    assert len(warnings) == 1 and "could not check" in warnings[0] and "`labels_key`" in warnings[0], warnings


def test_the_check_costs_three_forwards_per_real_micro_batch() -> None:
    """A right count: the whole micro-batch and its two halves (the trained loss stands for a second whole);
    fillers and micro-batches without two valid labels are not replayed."""
    data = ragged()
    cut = [sum(int((b["labels"] != IGNORE_INDEX).sum()) >= 2 for b in rank[:K]) for rank in data]
    assert cut == [2, 1], "the data changed: rank 1's first window holds a micro-batch with fewer than two labels"
    _, _, forwards = checked(data, ce)
    assert forwards == [3 * n for n in cut]
    _, _, forwards = checked(with_empty_first(data), ce)
    assert forwards == [3 * (n - 1) for n in cut]
    _, _, forwards = checked(data, ce, trained=False)
    assert forwards == [4 * n for n in cut]


def test_which_cuts_a_count_gets() -> None:
    batch = {"labels": torch.tensor([[1, 2]]), "x": torch.zeros(1, 2)}
    assert plan(count_valid_labels, batch, False) == ["labels", ROWS]
    assert plan(count_valid_labels, batch, True) == ["labels"]  # BatchNorm: rows are not cut
    assert labels_key(count_shifted_labels, {**batch, "shift_labels": batch["labels"]}) == "shift_labels"
    assert labels_key(ClassWeightedCount(WEIGHT), batch) == "labels"
    assert plan(count_examples, batch, False) == plan(count_sequences, batch, False) == [ROWS]
    assert labels_key(attention_mask_count, batch) == "labels"  # a count of one's own: checked on `labels`
    assert labels_key(count_after_two, {"targets": batch["labels"]}) == ROWS  # no labels: rows
    count_after_two_targets = lambda b: b  # noqa: E731
    count_after_two_targets.labels_key = "targets"  # type: ignore[attr-defined]
    assert labels_key(count_after_two_targets, {"targets": batch["labels"]}) == "targets"
    from token_mean import count_micro_batches

    assert plan(count_micro_batches, batch, False) == []  # one per micro-batch: nothing to check


def test_a_cut_splits_the_valid_labels_at_random() -> None:
    labels = torch.tensor([[-100, 5, 6, -100, 1], [3, 4, -100, 2, 2]])
    cut = labels_cut({"labels": labels, "x": torch.zeros(2, 5)}, "labels")
    assert cut is not None
    keep, rest = cut.keep["labels"], cut.rest["labels"]
    valid = labels != IGNORE_INDEX
    assert int((keep != IGNORE_INDEX).sum()) == 3 and int((rest != IGNORE_INDEX).sum()) == 4  # 0.382 of 7
    assert torch.equal(torch.where(keep != IGNORE_INDEX, keep, rest), labels.masked_fill(~valid, IGNORE_INDEX))
    assert labels_cut({"labels": torch.tensor([[-100, 9]])}, "labels") is None  # one valid label
    cut = labels_cut({"labels": labels}, "labels")
    assert cut is not None and torch.equal(cut.keep["labels"], keep)  # the same cut every time
    rows = rows_cut({"labels": torch.zeros(5, 2), "x": torch.ones(5, 4), "n": 3})
    assert rows is not None and rows.keep["x"].shape == (2, 4) and rows.rest["x"].shape == (3, 4)
    assert rows.keep["n"] == 3


# ---------------------------------------------------------------------------------------------------------------
# the front ends, one process: the Trainer replays `training_step`, Fabric the `loss_fn` it was given
# ---------------------------------------------------------------------------------------------------------------


class LossModule(TokenModule):
    """`training_step` returns `loss(net, batch)`; `net` the TokenNet subclass of the case."""

    def __init__(self, data: Data, loss: Loss, net: type[TokenNet] = TokenNet) -> None:
        super().__init__(data)
        state = self.net.state_dict()
        self.net = net()
        self.net.load_state_dict(state, strict=False)
        self.loss = loss

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return self.loss(self.net, batch)


def trainer_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`checked`'s settings as the strategy's arguments."""
    out = {k: v for k, v in settings.items() if k not in ("reduction", "terms", "net", "num_items")}
    if "reduction" in settings:
        out["loss_reduction"] = settings["reduction"]
    if "terms" in settings:
        out["count_fn"] = {name: count for name, count, _ in settings["terms"]}
    return out


def one_rank(data: Data, case: str) -> Data:
    """One rank's batches for a one-process run: rank 1's where the case's tell lies there, else rank 0's (whose
    micro-batches all hold valid labels and several rows)."""
    return [data[1 if case == "shift-prompt-masked-later-micro-batch" else 0]]


FRONT_END_WRONG = ["chunked-shifted-mean-declared-sum", "shifted-by-2-counted-shifted", "attention-mask-count-named",
                   "shift-prompt-masked-later-micro-batch", "attention-mask-count",
                   "mean-of-row-means-counted-with-tokens", "swapped-terms"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FRONT_END_WRONG)
def test_the_trainer_refuses_before_the_first_update(tmp_path: Path, case: str, mode: str) -> None:
    make_data, loss, settings, fix = WRONG[case]
    if mode == "deferred" and "terms" in settings:
        pytest.skip("several terms are lookahead's")
    from token_mean import TokenMeanDDPStrategy

    module = LossModule(one_rank(make_data(), case), loss)
    strategy = TokenMeanDDPStrategy(mode=mode, process_group_backend="gloo", **trainer_settings(settings))
    with pytest.raises(DenominatorError, match="the count check failed") as raised:
        fit(module, strategy, tmp_path, devices=1, accumulate_grad_batches=K)
    assert fix in str(raised.value) and "`training_step` replayed" in str(raised.value)
    assert not (tmp_path / "params.pt").exists()


@pytest.mark.parametrize("case", FRONT_END_WRONG)
def test_fabric_refuses_before_the_first_update(case: str) -> None:
    """#41 item 4: `TokenMeanAccumulator` checks the count by default, replaying its `loss_fn`."""
    from _fabric import accumulator_loop, fabric_for, launched

    make_data, loss, settings, fix = WRONG[case]
    kwargs = trainer_settings(settings)
    with pytest.raises(DenominatorError, match="the count check failed") as raised:
        launched(fabric_for("single"), accumulator_loop, one_rank(make_data(), case), K, "lookahead", loss_fn=loss,
                 **{"count_fn": count_valid_labels, **kwargs})
    assert fix in str(raised.value) and "the loss function replayed" in str(raised.value)


FRONT_END_RIGHT = ["cross-entropy-prompt-masked", "shifted-prompt-masked", "chunked-shifted", "row-weighted",
                   "dropout", "batchnorm", "sequences", "two-terms"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FRONT_END_RIGHT)
def test_the_trainer_trains_the_same_with_the_check_on_and_off(tmp_path: Path, case: str, mode: str) -> None:
    make_data, loss, settings = RIGHT[case]
    if mode == "deferred" and "terms" in settings:
        pytest.skip("several terms are lookahead's")
    from token_mean import TokenMeanDDPStrategy

    runs = {}
    for check_count in (True, False):
        module = LossModule(one_rank(make_data(), case), loss, settings.get("net", TokenNet))
        strategy = TokenMeanDDPStrategy(mode=mode, process_group_backend="gloo", check_count=check_count,
                                        **trainer_settings(settings))
        runs[check_count], _ = fit(module, strategy, tmp_path / str(check_count), devices=1,
                                   accumulate_grad_batches=K)
    assert same(runs[True], runs[False]), "the check changed the training"


@pytest.mark.parametrize("case", FRONT_END_RIGHT)
def test_fabric_trains_the_same_with_the_check_on_and_off(case: str) -> None:
    from _fabric import accumulator_loop, fabric_for, launched

    make_data, loss, settings = RIGHT[case]
    if "net" in settings:
        pytest.skip("the Fabric loop trains a TokenNet")
    kwargs = {"count_fn": count_valid_labels, **trainer_settings(settings)}
    runs = {check: launched(fabric_for("single"), accumulator_loop, one_rank(make_data(), case), K, "lookahead",
                            loss_fn=loss, check_count=check, **kwargs) for check in (True, False)}
    assert same(runs[True], runs[False])


def test_fabric_without_a_loss_fn_warns_that_it_cannot_check() -> None:
    from lightning.fabric import Fabric

    from token_mean.fabric import TokenMeanAccumulator

    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(TokenNet())
    with pytest.warns(UserWarning, match="cannot check the count: .* Pass `loss_fn=fn"):
        TokenMeanAccumulator(fabric, model, accumulate=2)
    with pytest.raises(TypeError, match="`loss_fn` must be a callable"):
        TokenMeanAccumulator(fabric, model, accumulate=2, loss_fn=3)  # type: ignore[arg-type]


def same(params: dict[str, Tensor], others: dict[str, Tensor]) -> bool:
    """Every parameter and buffer within 1e-15 relative (BatchNorm's step counter: equal)."""
    return params.keys() == others.keys() and all(
        torch.equal(value, others[key]) if not value.is_floating_point()
        else float((value - others[key]).norm()) <= 1e-15 * float(value.norm())
        for key, value in params.items()
    )


# ---------------------------------------------------------------------------------------------------------------
# every rank: the same refusal, and the same warning where one rank's replay fails (forked gloo processes)
# ---------------------------------------------------------------------------------------------------------------


def shifted_sum(net: nn.Module, batch: Batch) -> Tensor:
    return shifted(net, batch, "sum")


def shifted_count(batch: Batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_every_rank_refuses_a_shift_only_rank_1_can_see(tmp_path: Path, mode: str) -> None:
    """The tell-tale row is in rank 1's second micro-batch: both ranks raise the same error before the first update;
    with the check off the run misses the float64 reference, with the fix it names the run reaches it."""
    data = prompt_masked()
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(LossModule(data, shifted), strategy_for(mode),
                                                                  tmp_path / "refused", accumulate_grad_batches=K))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: token_mean: the count check failed at the accumulation window of"
                                " optimizer step 0 (epoch 0, batches 0..1)"), errors[0]
    assert "rank 1, micro-batch 1" in errors[0] and "Fix: `count_fn=token_mean.count_shifted_labels`" in errors[0]
    assert not (tmp_path / "refused" / "params.pt").exists()
    expected, _ = _harness.reference_steps(_harness.lightning_steps(data, K), loss_sum=shifted_sum,
                                           count=shifted_count)
    unchecked, _ = fit(LossModule(data, shifted), strategy_for(mode, check_count=False), tmp_path / "off",
                       accumulate_grad_batches=K)
    assert _harness.relative_error(unchecked, expected) > 1e-6, "the wrong count trained the objective: no case"
    right, _ = fit(LossModule(data, shifted), strategy_for(mode, count_fn=count_shifted_labels), tmp_path / "fixed",
                   accumulate_grad_batches=K)
    assert _harness.relative_error(right, expected) < EXACT


@pytest.mark.distributed
def test_fabric_every_rank_refuses_a_shift_only_rank_1_can_see() -> None:
    from _fabric import accumulator_loop, every_rank, forked_ranks, launched

    def loop(fabric: Any) -> list[str]:
        try:
            accumulator_loop(fabric, prompt_masked(), K, "lookahead", loss_fn=shifted, count_fn=count_valid_labels)
        except DenominatorError as error:
            return every_rank(str(error))
        return every_rank("trained")

    errors = launched(forked_ranks(), loop)
    assert len(set(errors)) == 1 and "rank 1, micro-batch 1" in errors[0], errors
    assert "Fix: `count_fn=token_mean.count_shifted_labels`" in errors[0]


class AccuracyModule(LossModule):
    """A shift in the step and a `MulticlassAccuracy` updated on the valid positions: where a replayed half holds no
    valid shifted label, the update raises as torchmetrics does (a legitimate step, #41 item 5). Rank r writes the
    warnings it gave into ``warnings{r}.txt``."""

    def __init__(self, data: Data, out: Path) -> None:
        from torchmetrics.classification import MulticlassAccuracy

        super().__init__(data, shifted)
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES)
        self.out = out

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        logits, labels = self.net(batch["x"])[:, :-1], batch["labels"][:, 1:]
        valid = labels != IGNORE_INDEX
        self.accuracy.update(logits[valid], labels[valid])  # raises on 0 elements
        return shifted(self.net, batch)

    def on_fit_start(self) -> None:
        import warnings

        self.caught = warnings.catch_warnings(record=True)
        self.warned = self.caught.__enter__()  # in the forked worker: its own warnings state
        warnings.simplefilter("always")

    def on_train_end(self) -> None:
        messages = [str(w.message) for w in self.warned]
        self.caught.__exit__(None, None, None)
        (self.out / f"warnings{self.global_rank}.txt").write_text("\n".join(messages))


@pytest.mark.distributed
def test_a_replay_failing_on_one_rank_warns_on_every_rank_and_trains(tmp_path: Path) -> None:
    """Rank 0's first micro-batch holds two valid labels, one at position 0, which the shifted step never scores: a
    half of it leaves the step nothing to score, and the step raises there, on rank 0 only. Every rank skips the
    check (rank 0 warns, as Lightning's warnings go) and the run trains as with the check off."""
    data = prompt_masked(tell=None)  # every micro-batch holds valid shifted labels, as the step needs
    data[0][0]["labels"] = torch.full_like(data[0][0]["labels"], IGNORE_INDEX)
    data[0][0]["labels"][0, :2] = torch.tensor([1, 2])
    runs = {}
    for check_count in (True, False):
        out = tmp_path / str(check_count)
        runs[check_count], _ = fit(AccuracyModule(data, out), strategy_for(
            "lookahead", count_fn=count_shifted_labels, check_count=check_count), out, accumulate_grad_batches=K)
    assert same(runs[True], runs[False])
    texts = [(tmp_path / "True" / f"warnings{rank}.txt").read_text() for rank in (0, 1)]
    warned = [[line for line in text.splitlines() if "count check" in line] for text in texts]
    assert len(warned[0]) == 1 and warned[1] == [], warned  # every rank skips the check; rank 0 says so
    assert "could not decide" in warned[0][0] and "cannot reshape tensor of 0 elements" in warned[0][0]
    assert "rank 0" in warned[0][0]


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 and FSDP2 × TP: the forwards are collectives, as many on every rank
# ---------------------------------------------------------------------------------------------------------------


class ShiftedMeshModule(MeshModule):
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return shifted(self.net, batch)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("data_parallel", "tensor_parallel"), [(2, 1), (2, 2)], ids=["fsdp2", "fsdp2xtp"])
def test_under_model_parallelism(tmp_path: Path, mode: str, data_parallel: int, tensor_parallel: int) -> None:
    """A shift with the default count that only rank 1's second micro-batch shows is refused on every rank; with
    `count_shifted_labels` the run trains the same parameters with the check on and off."""
    from test_model_parallel import strategy_for as mesh_strategy

    devices = data_parallel * tensor_parallel
    rank_data = prompt_masked()[:data_parallel]
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        ShiftedMeshModule(rank_data), mesh_strategy(mode, data_parallel, tensor_parallel), tmp_path / "refused",
        devices, accumulate_grad_batches=K), ranks=devices)
    assert len(set(errors)) == 1, errors
    assert "Fix: `count_fn=token_mean.count_shifted_labels`" in errors[0], errors[0]
    runs = {}
    for check_count in (True, False):
        strategy = mesh_strategy(mode, data_parallel, tensor_parallel, count_fn=count_shifted_labels,
                                 check_count=check_count)
        runs[check_count], _ = fit(ShiftedMeshModule(rank_data), strategy, tmp_path / str(check_count), devices,
                                   accumulate_grad_batches=K)
    assert same(runs[True], runs[False])


# ---------------------------------------------------------------------------------------------------------------
# cost in a real fit: three forwards per real micro-batch of the first window and one all_gather_object
# ---------------------------------------------------------------------------------------------------------------


class CountingModule(LossModule):
    """Counts its `training_step` calls and `all_gather_object` calls per rank; rank r writes ``calls{r}.json``."""

    def __init__(self, rank_data: Data, out: Path) -> None:
        super().__init__(rank_data, ce)
        self.out, self.steps, self.gathers = out, 0, 0

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def on_fit_start(self) -> None:
        import torch.distributed as dist

        original = dist.all_gather_object

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return original(*args, **kwargs)

        dist.all_gather_object = counted  # a forked worker's own module: the parent's stays as it was

    def on_fit_end(self) -> None:
        import json

        (self.out / f"calls{self.global_rank}.json").write_text(json.dumps([self.steps, self.gathers]))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_the_check_costs_three_forwards_per_micro_batch_and_one_gather_per_fit(tmp_path: Path, mode: str) -> None:
    """8 batches per rank, K = 2: 8 training steps and no gather without the check; with it, three more replayed
    steps per micro-batch of the first window that holds two valid labels, and one `all_gather_object`, whatever
    the number of windows."""
    import json

    data = _harness.ragged_batches(2, 8, seed=9)
    checkable = [sum(int((b["labels"] != IGNORE_INDEX).sum()) >= 2 for b in rank[:K]) for rank in data]
    calls = {}
    for check_count in (True, False):
        out = tmp_path / str(check_count)
        out.mkdir()
        fit(CountingModule(data, out), strategy_for(mode, check_count=check_count), out, accumulate_grad_batches=K)
        calls[check_count] = [json.loads((out / f"calls{rank}.json").read_text()) for rank in (0, 1)]
    assert calls[False] == [[8, 0], [8, 0]]
    assert calls[True] == [[8 + 3 * checkable[0], 1], [8 + 3 * checkable[1], 1]]
    assert checkable[0] + checkable[1] >= 3, "no case: a micro-batch without two valid labels is all it shows"


class MetricModule(LossModule):
    """Updates a `TokenMeanLoss` in `training_step`; rank r writes its computed value (over every rank)."""

    def __init__(self, rank_data: Data, out: Path) -> None:
        from token_mean import TokenMeanLoss

        super().__init__(rank_data, ce)
        self.out, self.metric = out, TokenMeanLoss()

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.metric.update(loss.detach(), count_valid_labels(batch))
        return loss

    def on_train_end(self) -> None:
        (self.out / f"metric{self.global_rank}.txt").write_text(repr(float(self.metric.compute())))


@pytest.mark.distributed
def test_a_metric_updated_in_training_step_sees_each_batch_once(tmp_path: Path) -> None:
    """The replays run `training_step`, whose metric updates are undone: the same value with the check on and off."""
    values = {}
    for check_count in (True, False):
        out = tmp_path / str(check_count)
        out.mkdir()
        module = MetricModule(_harness.ragged_batches(2, 4, seed=12), out)
        fit(module, strategy_for("lookahead", check_count=check_count), out, accumulate_grad_batches=K)
        values[check_count] = [(out / f"metric{rank}.txt").read_text() for rank in (0, 1)]
    assert values[True] == values[False]
