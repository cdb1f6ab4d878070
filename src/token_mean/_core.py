"""What a front end assembles the core from: the user's settings, checked once, and the mode they name.

Both the Trainer strategies and Fabric's accumulator take the same four settings and build the same modes; neither
needs the other's objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from token_mean._counting import CountFn
from token_mean._counts import count_valid_labels
from token_mean._deferred import Deferred, GradientPath
from token_mean._lookahead import Lookahead
from token_mean._mode import LossReduction, Mode, Settings, WindowCheck, WindowMode
from token_mean._record import Channel

MODES: tuple[Mode, ...] = ("lookahead", "deferred")
LOSS_REDUCTIONS: tuple[LossReduction, ...] = ("mean", "sum")


def checked_settings(count_fn: Any, loss_reduction: Any, mode: Any, pad_uneven_ranks: Any) -> tuple[Settings, Mode]:
    """The settings, or a ``ValueError`` naming the argument, its value and the fix."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"`loss_reduction` must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}: 'mean' if the loss is the"
            " mean over the micro-batch's valid items, 'sum' if it is their sum."
        )
    if count_fn is not None and not callable(count_fn):
        raise ValueError(f"`count_fn` must be a callable `count_fn(batch) -> int | float | Tensor`, got {count_fn!r}.")
    if not isinstance(pad_uneven_ranks, bool):
        raise ValueError(f"`pad_uneven_ranks` must be True or False, got {pad_uneven_ranks!r}.")
    function: CountFn = count_fn or count_valid_labels
    return Settings(function, count_fn is not None, loss_reduction, pad_uneven_ranks), mode


def make_mode(
    mode: Mode,
    channel: Channel,
    settings: Settings,
    gradients: Callable[[], GradientPath],
    checks: Sequence[WindowCheck] = (),
) -> WindowMode:
    """The mode named ``mode``; ``gradients`` builds deferred mode's path to the gradient (lookahead needs none)."""
    if mode == "lookahead":
        return Lookahead(channel, settings, checks)
    return Deferred(channel, settings, gradients(), checks)


__all__ = ["LOSS_REDUCTIONS", "MODES", "checked_settings", "make_mode"]
