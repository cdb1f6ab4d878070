"""The names a token-mean strategy hands through to its Lightning parent, checked at construction.

A name the parent does not take would otherwise fail after launch, inside each process (DDP's constructor gets
``DDPStrategy``'s ``**kwargs`` when it wraps the model), with Python's bare "unexpected keyword argument". A
``Trainer`` argument given to the strategy is the usual slip (``accumulate_grad_batches``): the message says where
it goes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any

import lightning.pytorch as pl

OWN = ("count_fn", "loss_reduction", "mode", "pad_uneven_ranks")


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


__all__ = ["check_passed_through", "named_parameters"]
