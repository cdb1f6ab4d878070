"""``TokenMeanModelParallelStrategy``: FSDP2 and tensor parallelism whose step follows the global token mean."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from token_mean import _lightning
from token_mean._layout import Outputs, check_reduction
from token_mean._settings import check_passed_through, named_parameters
from token_mean.strategy import TokenMeanStrategy

_PASSED_THROUGH = named_parameters(ModelParallelStrategy.__init__)


class TokenMeanModelParallelStrategy(TokenMeanStrategy, ModelParallelStrategy):
    r"""Lightning's ``ModelParallelStrategy`` (FSDP2 × TP) optimizing the mean loss over each step's valid items.

    :class:`~token_mean.TokenMeanDDPStrategy`'s objective, modes, counts and errors on Lightning's device mesh (apply
    the parallelism in ``configure_model``). N sums the counts over the data-parallel ranks; the tensor-parallel ranks
    must count alike (one MAX all-reduce of 2·K floats per window). FSDP2's mean over the data-parallel ranks, or one
    ``set_gradient_divide_factor(f)`` on every ``fully_shard`` module (torchtitan's sum: 1.0), scales each loss by
    P·n/N or f·n/N. Details: ``docs/model_parallel.md``.

    Args:
        count_fn, loss_reduction, mode, pad_uneven_ranks: as for :class:`~token_mean.TokenMeanDDPStrategy`.
        \**kwargs: passed unchanged to :class:`~lightning.pytorch.strategies.ModelParallelStrategy`.

    Raises:
        ValueError, TypeError: as for ``TokenMeanDDPStrategy``; in ``setup``, for a module sharded over another mesh
            than the data-parallel one, modules with different ``set_gradient_divide_factor`` factors, or torch <
            2.8's ``set_reduce_scatter_divide_factor`` (its factor is not kept).
        DenominatorError: on every rank at a window's end, if the tensor-parallel ranks count differently.

    Example:
        >>> import lightning.pytorch as pl
        >>> strategy = TokenMeanModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, mode="deferred")
        >>> trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, accumulate_grad_batches=4,
        ...                      logger=False, enable_checkpointing=False)
        >>> trainer = pl.Trainer(strategy="model_parallel_token_mean", accelerator="cpu", devices=2, logger=False,
        ...                      enable_checkpointing=False)
    """

    strategy_name = "model_parallel_token_mean"
    _outputs: Outputs | None = None  # of the sharded modules during a training step, from `setup` on

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Token-mean ModelParallelStrategy (FSDP2 × tensor parallelism)"
            )

    @override
    def _check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        check_passed_through(type(self).__name__, "ModelParallelStrategy", kwargs, _PASSED_THROUGH)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.model is not None:
            data_parallel = self.device_mesh["data_parallel"].size()
            if not check_reduction(self.model, data_parallel, type(self).__name__) and data_parallel > 1:
                rank_zero_warn(
                    f"`{type(self).__name__}`: no module is wrapped with `fully_shard`, but the data-parallel size is"
                    f" {data_parallel}. The token mean assumes the gradients are reduced over the data-parallel"
                    " ranks; apply `fully_shard(..., mesh=self.device_mesh['data_parallel'])` in `configure_model`."
                )
            self._outputs = Outputs(self.model)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._outputs is None:
            return super().training_step(*args, **kwargs)
        with self._outputs.kept():
            return super().training_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        if self._outputs is not None:
            self._outputs.remove()
            self._outputs = None
        super().teardown()

    @override
    def _stand_in_loss(self) -> Tensor:
        # a zero made of the outputs runs FSDP2's backward collectives: this rank stays in step until all raise
        loss = None if self._outputs is None else self._outputs.stand_in_loss()
        if loss is None:
            raise ValueError(
                f"token_mean: `training_step` returned no loss (None, or a dict without 'loss') on rank"
                f" {self.global_rank} under `{type(self).__name__}`, and ran no sharded module whose outputs could"
                " stand in for it: the other ranks now wait until the process group's `timeout`. Return the"
                " micro-batch's loss from every `training_step`."
            )
        return loss

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # restored after setup, never through `load_optimizer_state_dict`: the loops restore from what is returned
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        _lightning.replace_checkpoint_loader_states(checkpoint, partial(self._restore_token_mean_state, checkpoint))
        return checkpoint


TokenMeanModelParallelStrategy.register_strategies(StrategyRegistry)
