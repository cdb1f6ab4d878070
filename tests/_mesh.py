"""The harness's token model on Lightning's device mesh: FSDP2 over data-parallel ranks, tensor parallelism over the
rest, and forked workers for ``ModelParallelStrategy`` (which only has the subprocess launcher).

Used by ``tests/test_model_parallel.py`` and ``tests/scripts/model_parallel_token_mean.py``; the reference stays the
harness's plain-torch one.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from _harness import Batch, ListDataset, StreamDataset, TokenModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from torch.utils.data import DataLoader


class MeshModule(TokenModule):
    """``TokenModule`` parallelized in ``configure_model``: what a user writes for ``ModelParallelStrategy``.

    ``data`` holds one list of batches per data-parallel rank; the ranks of one tensor-parallel group read the same.
    """

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        assert mesh is not None
        if mesh["tensor_parallel"].size() > 1:
            plan = {"hidden": ColwiseParallel(), "out": RowwiseParallel()}
            parallelize_module(self.net, mesh["tensor_parallel"], plan)
        fully_shard(self.net, mesh=mesh["data_parallel"])

    @property
    def data_parallel_rank(self) -> int:
        mesh = self.device_mesh
        assert mesh is not None
        return int(mesh["data_parallel"].get_local_rank())

    def train_dataloader(self) -> DataLoader[Batch]:
        rank_batches = self.data[self.data_parallel_rank]
        dataset = StreamDataset(rank_batches) if self.iterable else ListDataset(rank_batches)
        return DataLoader(dataset, batch_size=None)


class _ForkLauncher(_MultiProcessingLauncher):
    """Lightning's fork launcher, sending back only the trainer's state: the workers write their results themselves
    (the parent's unsharded module cannot take FSDP2's sharded state dict)."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        if trainer.strategy.local_rank != 0:
            return None
        return _WorkerOutput(None, None, trainer.state, results, {})

    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        trainer.state = worker_output.trainer_state


def forked(strategy_class: type[ModelParallelStrategy]) -> type[ModelParallelStrategy]:
    """``strategy_class`` with forked workers (~0.2 s per run instead of ~4 s for re-importing torch per process)."""

    class Forked(strategy_class):  # type: ignore[valid-type, misc]
        def _configure_launcher(self) -> None:
            self._launcher = _ForkLauncher(self, start_method="fork")

    Forked.__name__ = Forked.__qualname__ = strategy_class.__name__
    return Forked


class ResumableMeshModule(MeshModule):
    """``MeshModule`` whose loader Lightning can resume mid-epoch (``_resume_helpers.PositionLoader``)."""

    def train_dataloader(self) -> DataLoader[Batch]:
        from _resume_helpers import PositionLoader

        return PositionLoader(ListDataset(self.data[self.data_parallel_rank]))
