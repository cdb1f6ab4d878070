"""What can make a window's denominator untrustworthy, with the fix: flags that ride the window's one collective,
so every rank raises the same :class:`DenominatorError` before the optimizer step."""

from __future__ import annotations

from enum import Enum


class Problem(Enum):
    """A problem of one rank's window: ``what`` went wrong and the ``fix`` that applies."""

    COUNT_FAILED = (
        "`count_fn` failed or returned something that is not a number",
        "make `count_fn(batch)` return an int, a float or a one-element tensor for every batch.",
    )
    COUNT_NEGATIVE = (
        "`count_fn` returned a negative count",
        "counts are numbers of valid items or sums of non-negative weights.",
    )
    COUNT_NONFINITE = (
        "`count_fn` returned a NaN or infinite count",
        "check the weights or mask that `count_fn` sums.",
    )
    COUNT_RANGE = (
        "the window's total count N is too small or too large for float64 to normalize by (1/N or N itself overflows)",
        "rescale the sample weights that `count_fn` sums (for example divide them by their mean); integer token"
        " counts never reach this.",
    )
    NO_LOSS = (
        "`training_step` returned no loss (None, or a dict without 'loss')",
        "return the micro-batch's loss (a tensor, or a dict with a 'loss' key) from every `training_step`.",
    )
    TERMS_MISMATCH = (
        "the terms `training_step` returned are not the terms `count_fn` names",
        "return a mapping with one loss per key of `count_fn` (and no other tensor), e.g. `{'lm': lm_loss, 'cls':"
        " cls_loss}` for `count_fn={'lm': ..., 'cls': ...}`; an 'aux_loss' averaged over micro-batches is a term of"
        " its own with `count_micro_batches` (docs/counts.md, objectives of several terms).",
    )
    BAD_LOSS = (
        "the loss of a micro-batch that the count says holds valid items is NaN or infinite (or count × loss"
        " overflows float64)",
        "if the loss averages over fewer items than `count_fn` counts (its mean is 0/0 = NaN when it sees none),"
        " make `count_fn` count exactly what the loss's own mask keeps (labels shifted inside the model? another"
        " ignore_index?); if the loss is NaN on valid items, check the inputs and the model's numerics.",
    )
    BAD_AUX_LOSS = (
        "the 'aux_loss' of a micro-batch is NaN or infinite",
        "check the auxiliary term; it is averaged over every real micro-batch, empty ones included.",
    )
    AUX_LOSS_DEFERRED = (
        "an 'aux_loss' came with the loss under `mode='deferred'`, which cannot normalize it: its token scale is"
        " only known after the last backward, when both terms already share one gradient buffer",
        "use `mode='lookahead'` (the default), where 'aux_loss' is averaged over micro-batches or each term can"
        " have its own count (`count_fn={'lm': ..., 'aux': ...}`, docs/counts.md, objectives of several terms);"
        " adding it to 'loss' would average it over the tokens.",
    )
    NUM_ITEMS_MISMATCH_COUNT_FN = (
        "`count_fn(batch)` and the 'num_items' reported with the loss (by `training_step`, or to"
        " `accumulator.backward`) disagree: two definitions of the denominator",
        "make them count the same items, or keep one of them (drop `count_fn`, or stop reporting 'num_items').",
    )
    NUM_ITEMS_MISMATCH_DEFAULT = (
        "the default count (`batch['labels'] != -100`) and the 'num_items' reported with the loss disagree",
        "pass the `count_fn` that counts what the loss averages over, for example"
        " `count_fn=token_mean.count_shifted_labels` when the model shifts the labels itself.",
    )
    COUNT_CHANGED = (
        "the batch `training_step` received holds a different count than the batch the loader yielded, which"
        " lookahead read ahead and normalized the window by: a hook between the loader and `training_step`"
        " (`on_before_batch_transfer`, `transfer_batch_to_device`, `on_after_batch_transfer`) changed the labels",
        "change the labels in the dataset or the `collate_fn` instead (they are then counted as trained), or use"
        " `mode='deferred'`, which counts the batch `training_step` receives.",
    )
    UNREDUCED_PARAMETER = (
        "a parameter that did not require a gradient when DDP wrapped the model has a gradient now (unfrozen"
        " later, as `BaseFinetuning` does): DDP never all-reduces its gradient, so the ranks' copies drift apart",
        "keep every trainable parameter `requires_grad=True` when `fit` starts and freeze by leaving parameters out"
        " of the optimizer (or with a learning rate of 0) until they should train; or unfreeze them before"
        " `fit`.",
    )
    ALIASED = (
        "a batch read ahead shares memory with a batch held or in flight: the loader refills one buffer in place, so"
        " the window would train other batches than the ones it counted",
        "make the loader yield fresh tensors (`.clone()`), or use `mode='deferred'`, which holds no window ahead"
        " (a stream's loader must still not refill the batch in flight: deferred mode reads one batch past each"
        " window to learn where the stream ends).",
    )
    UNEVEN = (
        "the ranks ran accumulation windows of different lengths",
        "give every rank the same number of batches, or keep `pad_uneven_ranks=True`.",
    )
    REPLICA_COUNTS_DIFFER = (
        "the ranks of one tensor-parallel group, which train on the same batches, counted different numbers of"
        " valid items (summing them would over-count the denominator)",
        "give every rank of a tensor-parallel group the same batches (shard the data by the data-parallel rank, as"
        " Lightning's sampler under `ModelParallelStrategy` does) and make `count_fn` depend on the batch alone.",
    )
    OUT_OF_STEP = (
        "the ranks are out of step: they reached different collectives of the package",
        "make every rank run the same batches and steps: a hook that ends an epoch on some ranks only"
        " (`on_train_batch_start` returning -1 on one rank, a `break` out of `accumulator.batches(...)` on one rank),"
        " a rank-dependent `max_steps`, `limit_train_batches` or data length without `pad_uneven_ranks`, or an"
        " exception caught on one rank leaves the others waiting.",
    )
    NO_BATCH = (
        "the rank's training loader yielded no batch this epoch while others did, so it has nothing to take part"
        " in DDP's backward with",
        "give every rank at least one batch.",
    )
    LONGER_THAN_LEN = (
        "the training loader yielded more batches than its `len()`: the epoch ends at `len()` (the stepping rule,"
        " the progress and the limits are sized by it), so the batches past it would never be trained",
        "make the loader's `__len__` exact (a token-budget batch sampler: count the batches it will yield), or"
        " yield the batches from an `IterableDataset`, whose length is taken as a hint: the ranks then agree on the"
        " epoch's end as the streams end, and every batch is trained.",
    )

    def __init__(self, what: str, fix: str) -> None:
        self.what = what
        self.fix = fix
