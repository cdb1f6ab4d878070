"""The names a token-mean strategy hands through to its Lightning parent, checked at construction.

A name the parent does not take would otherwise fail after launch, inside each process (DDP's constructor gets
``DDPStrategy``'s ``**kwargs`` when it wraps the model), with Python's bare "unexpected keyword argument". A
``Trainer`` argument given to the strategy is the usual slip (``accumulate_grad_batches``): the message says where
it goes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl

OWN = ("count_fn", "loss_reduction", "mode", "pad_uneven_ranks")
START_METHODS = ("popen", "spawn", "fork", "forkserver")  # DDPStrategy's `start_method` literal


def named_parameters(function: Callable[..., Any], leave_out: Collection[str] = ()) -> frozenset[str]:
    """The keyword names ``function`` takes, less ``self``, ``*args``/``**kwargs`` and ``leave_out``."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in kinds and name != "self" and name not in leave_out
    )


def check_passed_through(strategy: str, parent: str, kwargs: Mapping[str, Any], accepted: Collection[str]) -> None:
    """A ``TypeError`` for the first name in ``kwargs`` that ``accepted`` lacks, saying where it belongs."""
    trainer_arguments = named_parameters(pl.Trainer.__init__)
    for name, value in kwargs.items():
        if name in accepted:
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


def check_parent_values(strategy: str, kwargs: Mapping[str, Any]) -> None:
    """A ``ValueError`` for a value of the parent's own arguments that would fail only once processes start."""
    for name, value in kwargs.items():
        rule = _PARENT_VALUES.get(name)
        if rule is not None and not rule[0](value):
            raise ValueError(f"`{strategy}`: `{name}` must be {rule[1]}, got {value!r}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_or_auto(value: Any) -> bool:
    return value == "auto" or (_is_int(value) and value >= 1)


_PARENT_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "start_method": (lambda v: v in START_METHODS, f"one of {START_METHODS}"),
    "timeout": (lambda v: v is None or isinstance(v, timedelta), "a `datetime.timedelta` (or None)"),
    "process_group_backend": (lambda v: v is None or isinstance(v, str), "a backend name such as 'gloo' (or None)"),
    "data_parallel_size": (_positive_or_auto, "'auto' or a positive int"),
    "tensor_parallel_size": (_positive_or_auto, "'auto' or a positive int"),
}
"""The parent's own arguments whose bad values would fail only after launch: (the check, what is expected)."""


__all__ = ["check_parent_values", "check_passed_through", "named_parameters"]
