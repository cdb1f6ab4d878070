"""What a front end assembles the core from: the user's settings, checked once, the layout, and the mode they name.

The Trainer strategies, Fabric's accumulator and the monitor take the same settings and layouts and build the same
modes; none needs another's objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from token_mean._counting import CountFn
from token_mean._counts import count_valid_labels
from token_mean._deferred import Deferred, GradientPath
from token_mean._lookahead import Lookahead
from token_mean._mode import LossReduction, Mode, Settings, WindowCheck, WindowMode
from token_mean._record import Channel, Reduced, World

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


@dataclass(frozen=True)
class Layout:
    """What a parallel layout (``_ddp.layout``, ``_fsdp.layout``) gives the core, under any front end.

    ``world``: the ranks that share a denominator; ``gradients``: builds deferred mode's path to the gradient;
    ``checks``: host-side checks run as each window closes; ``on_out_of_step``: what this rank still does when a
    blocking collective finds the ranks out of step (None: the others then wait for the timeout in their backward);
    ``catch_up``: what the others' next forward runs that a rank whose epoch ended must take part in;
    ``sync_flags``: the gradient-sync flags the next backward will use, read on the host (none: nothing reduces).
    """

    world: World
    gradients: Callable[[], GradientPath]
    checks: Sequence[WindowCheck] = ()
    on_out_of_step: Callable[[Reduced], None] | None = None
    catch_up: Callable[[], None] | None = None
    sync_flags: Callable[[], Sequence[bool]] = tuple


def make_mode(mode: Mode, layout: Layout, settings: Settings, rank_counts: bool) -> WindowMode:
    """The mode named ``mode`` over ``layout``; ``rank_counts`` adds every rank's count to each record."""
    channel = Channel(layout.world, rank_counts, layout.on_out_of_step)
    if mode == "lookahead":
        return Lookahead(channel, settings, layout.checks)
    return Deferred(channel, settings, layout.gradients(), layout.checks)


__all__ = ["LOSS_REDUCTIONS", "MODES", "Layout", "checked_settings", "make_mode"]
