"""Count what a Fabric loop costs besides the model, as ``tests/_cost.py`` counts a Trainer fit.

The loops are ``tests/_fabric.py``'s: LitGPT's (``fabric.backward(loss / K)`` inside ``no_backward_sync``), the
baseline in absolute numbers, and the same loop with ``TokenMeanAccumulator`` in each mode, on 2 forked gloo ranks
under Fabric's ``DDPStrategy``, over the Trainer runs' data, K, windows and passes (``_cost.cost_data``), through
``fabric.setup_dataloaders`` (a sized and an unsized loader). :class:`FabricCostCounter` is ``_cost.Tallies`` told
the loop's cycles: a cycle runs from the loop receiving one batch (what ``accumulator.batches`` or the loader yields)
to its receiving the next, so the accumulator's work between two batches (the read-ahead, the window's opening)
belongs to the cycle it follows, as the Trainer's batch fetch does. A window's in-window tally runs from its first
forward (the ``_FabricModule``'s) to the end of its last ``fabric.backward``; ``accumulator.finish()`` reads the
window's record after it. ``_cost.summarize`` turns each rank's tallies into a ``Cost``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from _cost import ACCUMULATE, BATCHES, DEVICES, EPOCHS, Cost, Row, Tallies, cost_data, summarize
from _fabric import accumulator_loop, fabric_for, plain_loop, shifted_loss
from _harness import Batch
from torch import Tensor, nn

METHODS = ("litgpt", "lookahead", "deferred")
LossFn = Callable[[nn.Module, Batch], Tensor]


class FabricCostCounter(Tallies):
    """The cycles and windows of a Fabric loop over passes of ``BATCHES`` batches, K = ``ACCUMULATE``."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._passes = 0

    def attach(self, fabric: Any) -> None:
        """Count from now on: ``fabric.backward`` bounds the backward, each module set up reports its forward."""
        setup_module = fabric.setup_module

        def counted_setup(*args: Any, **kwargs: Any) -> Any:
            model = setup_module(*args, **kwargs)
            handle = model.register_forward_pre_hook(lambda module, inputs: self.first_forward())
            self._restore.append(handle.remove)
            return model

        fabric.setup_module = counted_setup
        self._restore.append(lambda: fabric.__dict__.pop("setup_module", None))
        self.wrap(fabric, "backward", self.backward_starts, self.backward_done)
        self.start()

    def batches(self, iterable: Iterable[Batch]) -> Iterator[Batch]:
        """One pass of what the loop iterates; each batch it receives starts a cycle."""
        epoch = self._passes
        self._passes += 1
        for position, batch in enumerate(iterable):
            micro = position % ACCUMULATE
            self.cycle(epoch, position // ACCUMULATE, micro, micro == ACCUMULATE - 1 or position == BATCHES - 1)
            yield batch


def run(method: str, loader: str, directory: Path, loss_fn: LossFn = shifted_loss) -> list[dict[str, Any]]:
    """One 2-rank run of EPOCHS passes of K = ACCUMULATE windows, LitGPT's loop or a mode; every rank's tallies."""
    directory.mkdir(parents=True, exist_ok=True)
    fabric_for("ddp").launch(_counted, method, loader, directory, loss_fn)
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(DEVICES)]


def _counted(fabric: Any, method: str, loader: str, directory: Path, loss_fn: LossFn) -> None:
    counter = FabricCostCounter(directory)
    counter.attach(fabric)
    try:
        if method == "litgpt":
            plain_loop(fabric, cost_data(), ACCUMULATE, EPOCHS, loss_fn, loader, counter.batches)
        else:
            accumulator_loop(fabric, cost_data(), ACCUMULATE, method, EPOCHS, loss_fn=loss_fn, loader=loader,
                             observe=counter.batches)
    finally:
        counter.stop()
    counter.write(fabric.global_rank)


def measure(loader: str, directory: Path) -> list[Row]:
    """LitGPT's loop (absolute), then each mode's extra over it, on one kind of loader."""
    baseline: Cost | None = None
    rows = []
    for method in METHODS:
        costs = [summarize(rank) for rank in run(method, loader, directory / f"fabric-{loader}-{method}")]
        if costs[0].collectives_per_window != costs[1].collectives_per_window:
            raise AssertionError(f"ranks run different collectives: {costs}")
        if baseline is None:
            baseline = costs[0]
            rows.append(Row(method, loader, False, baseline))
        else:
            rows.append(Row(method, loader, False, costs[0].minus(baseline)))
    return rows


__all__ = ["METHODS", "FabricCostCounter", "measure", "run"]
