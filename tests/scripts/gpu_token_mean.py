"""Train the ragged token-level case on CUDA with NCCL under Lightning's subprocess launcher, one process per device,
and record what only a GPU run shows. Used by ``tests/test_gpu.py``; needs CUDA.

Rank 0 writes OUT_DIR/params.pt and OUT_DIR/windows.json (``_harness.Recorder``); every rank writes
OUT_DIR/rank{r}.json: how often deferred mode's DDP comm hook ran and how often it took NCCL's ``PREMUL_SUM``
(``token_mean._torch.premul_sum``), the length of every window, and every synchronizing CUDA operation
(``torch.cuda.set_sync_debug_mode("warn")``) between a window's first forward and the end of its last backward, with
the phase it came in (``step``: inside the strategy's ``training_step`` or ``backward``, up to the end of
``LightningModule.backward``; ``between``: Lightning's loop between micro-batches), its origin (the innermost frame
outside torch: ``token_mean``, ``lightning`` or ``other``) and its stack. The strategy's read of the window's record
after the last backward is outside the window, as the package documents it.

    python tests/scripts/gpu_token_mean.py OUT_DIR --strategy ddp --method deferred --devices 1
    python tests/scripts/gpu_token_mean.py OUT_DIR --strategy fsdp2 --method lookahead --devices 2
    python tests/scripts/gpu_token_mean.py OUT_DIR --strategy ddp --method plain --reads   # the watch's control

``--reads``: ``training_step`` reads its loss on the host and a backward hook reads the loss's gradient, in every
micro-batch: what the watch must see.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cost import wrap_around
from _harness import Batch, Recorder, TokenModule, empty_like, ragged_batches
from _mesh import MeshModule

import token_mean
from token_mean import TokenMeanDDPStrategy, TokenMeanModelParallelStrategy, _layout, _lightning, _torch

DATA_SEED, BATCHES, ACCUMULATE = 23, 12, 3  # 4 windows of 3
STEADY = 2  # windows from this one on: DDP rebuilt its buckets and FSDP2 initialized in the first two
STRATEGIES = ("ddp", "fsdp2")
METHODS = ("plain", "lookahead", "deferred")
SYNC = "called a synchronizing CUDA operation"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TOKEN_MEAN_DIR = os.path.dirname(token_mean.__file__) + os.sep
_LIGHTNING_DIR = os.path.dirname(lightning.__file__) + os.sep
_WARNINGS_FILE = warnings.__file__


def data(ranks: int) -> list[list[Batch]]:
    """Ragged per-rank batches, with a fully masked micro-batch on rank 0 (a 0/0 mean on CUDA)."""
    batches = ragged_batches(ranks, BATCHES, seed=DATA_SEED)
    batches[0][4] = empty_like(batches[0][4])
    return batches


# ---------------------------------------------------------------------------------------------------------------
# deferred mode's comm hook and NCCL's PREMUL_SUM, counted in every rank
# ---------------------------------------------------------------------------------------------------------------


class Calls:
    hook = 0  # bucket all-reduces through deferred mode's comm hook
    premul_sum = 0  # of which built NCCL's PREMUL_SUM op


def count_hook_calls() -> None:
    """Wrap the hook before DDP registers it (``_layout._install_hook`` reads the module global) and the op."""
    hook, premul_sum = _layout.scaled_allreduce_hook, _torch.premul_sum

    # No annotations: DDP compares a hook's annotations with the real classes (see token_mean/_comm_hook.py).
    def counted_hook(state, bucket):  # type: ignore[no-untyped-def]
        Calls.hook += 1
        return hook(state, bucket)

    def counted_premul_sum(factor: Tensor) -> Any:
        Calls.premul_sum += 1
        return premul_sum(factor)

    _layout.scaled_allreduce_hook = counted_hook
    _torch.premul_sum = counted_premul_sum


# ---------------------------------------------------------------------------------------------------------------
# synchronizing CUDA operations inside each window
# ---------------------------------------------------------------------------------------------------------------


def _origin(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """Who issued the operation: the innermost frame outside torch (and the warning machinery), as an origin and
    ``file:line in function`` (relative to its package)."""
    for frame in reversed(stack):
        if frame.filename == _WARNINGS_FILE or frame.filename.startswith(_TORCH_DIR):
            continue
        for origin, directory in (("token_mean", _TOKEN_MEAN_DIR), ("lightning", _LIGHTNING_DIR)):
            if frame.filename.startswith(directory):
                return origin, f"{origin}/{frame.filename[len(directory):]}:{frame.lineno} in {frame.name}"
        return "other", f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return "other", "?"


class SyncWatch(Callback):
    """Records every synchronizing CUDA operation from a window's first forward (``LightningModule.training_step``)
    to the end of its last backward (the debug mode is on only then); each rank writes them to ``rank{r}.json`` with
    the comm hook counts. The phase is ``step`` inside the strategy's ``training_step`` and ``backward``.

    Sync debug mode is process-wide, so the autograd engine's device threads (the backward, DDP's comm hook) are
    watched too; their warnings reach ``warnings.showwarning`` in the thread that issued them.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.window_lengths: list[int] = []
        self.syncs: list[dict[str, Any]] = []
        self._window: int | None = None
        self._phase = "between"
        self._closes = False  # the micro-batch in flight is its window's last
        self._show_previous: Callable[..., Any] | None = None

    def _show(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        window = self._window
        if not str(message).startswith(SYNC) or window is None:
            if self._show_previous is not None:
                self._show_previous(message, category, filename, lineno, *rest)
            return
        stack = traceback.extract_stack()[:-1]  # without this frame
        origin, where = _origin(stack)
        kept = [frame for frame in stack if frame.filename != _WARNINGS_FILE][-13:]
        self.syncs.append({
            "window": window, "phase": self._phase, "origin": origin, "where": where,
            "stack": "".join(traceback.format_list(kept)),
        })

    def _begin_micro_batch(self, trainer: pl.Trainer) -> None:
        self._closes = _lightning.steps_after_this_batch(trainer)
        self._phase = "step"

    def _forward(self) -> None:
        if self._window is None:
            self._window = len(self.window_lengths)
            self.window_lengths.append(0)
            torch.cuda.set_sync_debug_mode("warn")
        self.window_lengths[self._window] += 1

    def _forward_done(self) -> None:
        self._phase = "between"

    def _backward_done(self) -> None:
        self._phase = "between"
        if self._closes:
            torch.cuda.set_sync_debug_mode("default")
            self._window = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        wrap_around(strategy, "training_step", lambda: self._begin_micro_batch(trainer), self._forward_done)
        # the window opens at its first forward: lookahead counts an epoch's first window before it, as documented
        wrap_around(pl_module, "training_step", self._forward, None)
        wrap_around(strategy, "backward", lambda: setattr(self, "_phase", "step"), None)
        # ... and ends with the backward itself: the strategy's `backward` reads the window's record after it
        wrap_around(pl_module, "backward", None, self._backward_done)
        warnings.filterwarnings("always", message=SYNC)
        self._show_previous, warnings.showwarning = warnings.showwarning, self._show

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("default")
        record = {
            "rank": trainer.global_rank, "hook_calls": Calls.hook, "premul_sum_calls": Calls.premul_sum,
            "window_lengths": self.window_lengths, "syncs": self.syncs,
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# the fit
# ---------------------------------------------------------------------------------------------------------------


def read_loss_and_its_gradient(module: TokenModule, batch: Batch, loss: Tensor) -> Tensor:
    """The watch's control: a host read in the forward, and one in the backward, of every micro-batch."""
    float(loss)
    if loss.requires_grad:
        loss.register_hook(_read_gradient)
    return loss


def _read_gradient(gradient: Tensor) -> None:
    float(gradient)


def strategy_for(strategy: str, method: str, devices: int) -> Strategy:
    if strategy == "ddp":
        if method == "plain":
            return DDPStrategy(process_group_backend="nccl")
        return TokenMeanDDPStrategy(mode=method, process_group_backend="nccl")  # type: ignore[arg-type]
    sizes: dict[str, Any] = {"data_parallel_size": devices, "tensor_parallel_size": 1, "process_group_backend": "nccl"}
    if method == "plain":
        return ModelParallelStrategy(**sizes)
    return TokenMeanModelParallelStrategy(mode=method, **sizes)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--method", choices=METHODS, default="deferred")
    parser.add_argument("--devices", type=int, default=1, help="processes, one per CUDA device")
    parser.add_argument("--reads", action="store_true", help="training_step and its backward read on the host")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_token_mean.py needs CUDA: run it on a machine with a GPU (tests/test_gpu.py skips without one)")
    args.out.mkdir(parents=True, exist_ok=True)
    count_hook_calls()
    module_class = MeshModule if args.strategy == "fsdp2" else TokenModule
    module = module_class(data(args.devices), output_fn=read_loss_and_its_gradient if args.reads else None)
    trainer = pl.Trainer(
        accelerator="gpu", devices=args.devices, strategy=strategy_for(args.strategy, args.method, args.devices),
        accumulate_grad_batches=ACCUMULATE, max_epochs=1, callbacks=[Recorder(args.out), SyncWatch(args.out)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(module)
    torch.distributed.destroy_process_group()  # before the interpreter finalizes (see test_spawn_launcher)


if __name__ == "__main__":
    main()
