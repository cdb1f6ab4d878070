"""Every user setting, checked once where it is given (one error per mistake, the same everywhere), a strategy's
parent arguments included: a bad one would otherwise fail only after launch, in every process."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple

LossReduction = Literal["mean", "sum"]
Mode = Literal["lookahead", "deferred"]
CountFn = Callable[[Any], Any]  # -> int | float | one-element Tensor; `Any` so YAML can name an unannotated function


class Term(NamedTuple):
    """One term of an objective of several."""

    name: str  # the key of its loss in the step's output, and of its count
    count_fn: CountFn
    reduction: LossReduction


RESERVED = ("loss", "aux_loss", "num_items")  # keys of a step's output with a meaning of their own

MODES: tuple[Mode, ...] = ("lookahead", "deferred")
LOSS_REDUCTIONS: tuple[LossReduction, ...] = ("mean", "sum")
OWN = ("count_fn", "loss_reduction", "mode", "pad_uneven_ranks", "check_count")
START_METHODS = ("popen", "spawn", "fork", "forkserver")  # DDPStrategy's `start_method` literal


@dataclass(frozen=True)
class Settings:
    """The objective and the mode a front end normalizes with, checked (:func:`checked_settings`)."""

    count_fn: CountFn
    count_fn_given: bool  # False: the default count, which changes the advice of a `num_items` mismatch
    loss_reduction: LossReduction
    pad_uneven_ranks: bool
    mode: Mode = "lookahead"
    check_count: bool = True  # the count check at a fit's first window (Trainer strategies)
    terms: tuple[Term, ...] = ()  # an objective of several terms (then `count_fn` sums their counts), else ()


def checked_settings(
    count_fn: Any, loss_reduction: Any, mode: Any, pad_uneven_ranks: Any, check_count: Any = True
) -> Settings:
    """The settings, or a ``ValueError`` naming the argument, its value and the fix."""
    from token_mean._counts import count_valid_labels

    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    for name, value in (("pad_uneven_ranks", pad_uneven_ranks), ("check_count", check_count)):
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    if isinstance(count_fn, Mapping):
        terms = checked_terms(count_fn, loss_reduction, mode)
        return Settings(_total(terms), True, "mean", pad_uneven_ranks, mode, check_count, terms)
    if isinstance(loss_reduction, Mapping):
        raise ValueError(
            f"`loss_reduction` is a mapping ({dict(loss_reduction)!r}) but `count_fn` is not: an"
            " objective of several terms names its counts in a mapping with the same keys."
        )
    return Settings(
        checked_count_fn(count_fn) or count_valid_labels,
        count_fn is not None,
        checked_loss_reduction(loss_reduction) or "mean",
        pad_uneven_ranks,
        mode,
        check_count,
    )


def checked_terms(count_fn: Mapping[Any, Any], loss_reduction: Any, mode: Any) -> tuple[Term, ...]:
    """The terms of ``count_fn={name: count}`` and ``loss_reduction`` (one for all, or a mapping with the same keys),
    or a ``ValueError`` naming the argument, its value and the fix (docs/counts.md, objectives of several terms)."""
    names = list(count_fn)
    if not names or any(not isinstance(name, str) or not name or name in RESERVED for name in names):
        raise ValueError(
            f"`count_fn` as a mapping names the terms of the objective: non-empty str keys other than"
            f" {RESERVED}, got keys {names!r}."
        )
    reductions = loss_reduction if isinstance(loss_reduction, Mapping) else dict.fromkeys(names, loss_reduction)
    if set(reductions) != set(names):
        raise ValueError(
            f"`loss_reduction` must name the same terms as `count_fn` ({sorted(names)}), got"
            f" {sorted(reductions)}; or pass one reduction for every term."
        )
    if mode != "lookahead":
        raise ValueError(
            f"`count_fn` with several terms ({sorted(names)}) needs `mode='lookahead'`: deferred mode corrects the"
            " scale with one factor D/N after the window's last backward, when the terms already share one gradient,"
            " so it cannot give each term its own N. Use `mode='lookahead'` (the default)."
        )
    return tuple(
        Term(
            name, checked_count_fn(count_fn[name]) or _missing(name), checked_loss_reduction(reductions[name]) or "mean"
        )
        for name in names
    )


def _missing(name: str) -> CountFn:
    raise TypeError(
        f"`count_fn[{name!r}]` is None: give each term a count (`token_mean.count_micro_batches` for a"
        " term averaged over micro-batches)."
    )


def _total(terms: tuple[Term, ...]) -> CountFn:
    """One count for the whole objective: what its terms count together (where one figure is needed)."""
    counts = [term.count_fn for term in terms]
    return lambda batch: sum(count(batch) for count in counts)


def checked_count_fn(count_fn: Any) -> CountFn | None:
    if count_fn is not None and not callable(count_fn):
        raise TypeError(
            f"`count_fn` must be a callable `count_fn(batch) -> int | float | Tensor`, got {type(count_fn).__name__}:"
            f" {count_fn!r}. Pass e.g. `count_fn=token_mean.count_examples`, or leave it out."
        )
    return count_fn  # type: ignore[no-any-return]


def checked_loss_reduction(loss_reduction: Any) -> LossReduction | None:
    if loss_reduction is not None and loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"`loss_reduction` must be 'mean' (the loss is the mean over the micro-batch's valid items) or 'sum'"
            f" (their sum), got {loss_reduction!r}."
        )
    return loss_reduction  # type: ignore[no-any-return]


def positive_int(value: Any, name: str, what: str, none: str | None = None) -> int | None:
    """``value``, or a ``ValueError`` unless it is an int >= 1 (``none``: what None means, when None is allowed)."""
    if none is not None and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        alternative = f" or None ({none})" if none is not None else ""
        raise ValueError(f"`{name}` must be a positive int ({what}){alternative}, got {value!r}.")
    return value


def named_parameters(function: Callable[..., Any], leave_out: Collection[str] = ()) -> frozenset[str]:
    """The keyword names ``function`` takes, less ``self``, ``*args``/``**kwargs`` and ``leave_out``."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in kinds and name != "self" and name not in leave_out
    )


def check_passed_through(strategy: str, parent: str, kwargs: Mapping[str, Any], accepted: Collection[str]) -> None:
    """A ``TypeError`` for a name ``accepted`` lacks (saying where it belongs), a ``ValueError`` for a bad value."""
    import lightning.pytorch as pl

    trainer_arguments = named_parameters(pl.Trainer.__init__)
    for name, value in kwargs.items():
        if name in accepted:
            rule = _PARENT_VALUES.get(name)
            if rule is not None and not rule[0](value):
                raise ValueError(f"`{strategy}`: `{name}` must be {rule[1]}, got {value!r}.")
            continue
        if name in trainer_arguments:
            raise TypeError(
                f"`{strategy}` got `{name}={value!r}`, which is a `Trainer` argument: pass `{name}` to the `Trainer`"
                f" (`pl.Trainer(..., {name}={value!r}, strategy={strategy}(...))`), not to the strategy."
            )
        raise TypeError(
            f"`{strategy}` got an unexpected argument `{name}={value!r}`. It takes {', '.join(f'`{n}`' for n in OWN)}"
            f" and the arguments of `{parent}`: {', '.join(f'`{n}`' for n in sorted(accepted))}."
        )


def _positive_or_auto(value: Any) -> bool:
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


_PARENT_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "start_method": (lambda v: v in START_METHODS, f"one of {START_METHODS}"),
    "timeout": (lambda v: v is None or isinstance(v, timedelta), "a `datetime.timedelta` (or None)"),
    "process_group_backend": (lambda v: v is None or isinstance(v, str), "a backend name such as 'gloo' (or None)"),
    "data_parallel_size": (_positive_or_auto, "'auto' or a positive int"),
    "tensor_parallel_size": (_positive_or_auto, "'auto' or a positive int"),
}
"""The parent's own arguments whose bad values would fail only after launch: (the check, what is expected)."""
