"""What a layer may follow of a front end's first window without reaching into it (the count check is one): each
micro-batch as its forward starts and what it trained on, then, after the window's last backward and before its
update, how to replay its loss. A layer adds a factory to :data:`FIRST_WINDOW` when it is imported (the package's
``__init__`` imports every layer), so the front ends import no layer."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from token_mean._layout import World
from token_mean._settings import Settings


@dataclass(frozen=True)
class Replay:
    """How the front end computes a micro-batch's loss, for a replay without gradient: ``loss_fn(module, batch,
    index)`` gives the step's output on the unwrapped ``module`` under the forward's precision ``context``;
    ``world``: the ranks that share N; ``step``: how messages name what is replayed."""

    module: nn.Module
    loss_fn: Callable[[nn.Module, Any, int], Any]
    context: Callable[[], AbstractContextManager[Any]]
    world: World
    step: str


class FirstWindowObserver(Protocol):
    def micro_batch(self, batch: Any, filler: bool, index: int) -> None:
        """The micro-batch's forward is about to run (``index``: its position in the pass)."""

    def trained(self, output: Any) -> None:
        """The micro-batch's forward gave ``output`` (the step's output, or the loss given to the accumulator)."""

    def ended(self, replay: Replay, where: str) -> None:
        """The window's last backward ran, its update has not: the observer may raise, on every rank."""


FIRST_WINDOW: list[Callable[[Settings, bool], FirstWindowObserver | None]] = []
"""Factories of observers of a fit's (an accumulator's) first window: ``(settings, a loss can be replayed)`` → an
observer, or None."""


def first_window_observers(settings: Settings, replayable: bool) -> list[FirstWindowObserver]:
    return [observer for factory in FIRST_WINDOW if (observer := factory(settings, replayable)) is not None]
