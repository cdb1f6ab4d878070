"""``TokenMeanModelParallelStrategy``: FSDP2 and tensor parallelism whose step follows the global token mean."""

from __future__ import annotations

from collections.abc import Mapping
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
    r"""Lightning's ``ModelParallelStrategy`` (FSDP2 × tensor parallelism) optimizing the mean loss over all valid
    items of each optimizer step.

    The same objective, modes, counts, errors and :class:`~token_mean.WindowStats` as
    :class:`~token_mean.TokenMeanDDPStrategy` (see there), on Lightning's ``("data_parallel", "tensor_parallel")``
    device mesh. You apply the parallelism in ``configure_model`` as for ``ModelParallelStrategy``: tensor
    parallelism over ``self.device_mesh["tensor_parallel"]``, then ``fully_shard(..., mesh=self.device_mesh[
    "data_parallel"])``. What differs from DDP:

    - **Whose counts add up.** The ranks of one tensor-parallel group train on the same batches, so N sums the counts
      over the data-parallel ranks only (P = the data-parallel size): the window's record is all-reduced over the
      data-parallel group. Summing over all ranks would over-count N by the tensor-parallel size.
    - **Tensor-parallel ranks must count alike.** Each window, the counts of its micro-batches are compared over the
      tensor-parallel group (one MAX all-reduce of 2·K float64; exact for any float count; none without tensor
      parallelism). A difference is a flag in the window's record, so every rank raises the same
      :class:`~token_mean.DenominatorError` before the optimizer step, instead of silently over-counting. Ranks named
      in such errors are data-parallel ranks.
    - **How the scale reaches the gradient.** ``fully_shard`` reduce-scatters every micro-batch's gradient and
      divides it by P (its default ``gradient_divide_factor``, in any ``reduce_dtype``; Lightning does not use
      ``no_sync`` here). ``"lookahead"`` scales each micro-batch's loss by P·n/N before its backward, as under
      DDP: FSDP2's mean then gives Σ∇(loss sums)/N exactly, with nothing added to the backward. ``"deferred"``
      back-propagates loss sums over a provisional D, so the sharded gradients hold Σ∇(loss sums)/(P·D) after the
      window's last backward; one ``torch._foreach_mul_`` of this rank's local shards by P·D/N (a device tensor
      that waits for the window's all-reduce on the device: no host read) makes them exact, after the closure and
      before clipping, AMP's unscale and ``on_before_optimizer_step``. That pass touches 1/P of the gradients.
      Setting FSDP2's divide factor instead would need N as a host float before every micro-batch's reduce-scatter,
      which deferred mode does not have: the multiplication is the exact and cheap choice. Because FSDP2 mixes the
      ranks' gradients before that factor, D must be the same on every rank: the run's first window agrees on it
      with one all-reduce of one float (later windows use the previous window's N/P, which every rank has).
    - The strategy relies on FSDP2's default mean: a module with ``set_gradient_divide_factor`` or sharded over
      another number of ranks than the data-parallel size is an error in ``setup``.

    A ``training_step`` that returns no loss back-propagates a zero made of the outputs of the outermost sharded
    modules it ran instead (FSDP2's backward collectives hang on them), so every rank raises the same error at the
    window's end; only a step that ran no sharded module raises at once on its own rank, the others then failing at
    the process group's ``timeout``.

    Per window this costs what the DDP strategy costs (one all-reduce of a small record, over the data-parallel
    group, read on the host once after the last backward), plus the tensor-parallel count check above and, in
    deferred mode, the multiplication of the local gradient shards.

    Args:
        count_fn, loss_reduction, mode, pad_uneven_ranks: as for :class:`~token_mean.TokenMeanDDPStrategy`.
        \**kwargs: passed unchanged to :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
            (``data_parallel_size``, ``tensor_parallel_size``, ``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``).

    Raises:
        TypeError: for an argument ``ModelParallelStrategy`` does not take (a ``Trainer`` argument such as
            ``accumulate_grad_batches`` goes to the ``Trainer``).
        ValueError: for an unknown ``mode`` or ``loss_reduction`` or a ``count_fn`` that is not callable; in
            ``setup``, for an FSDP2 module with its own gradient divide factor or sharded over a mesh other than the
            data-parallel one.

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
                    f" {data_parallel}. The token mean assumes the gradients are averaged over the data-parallel"
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
        # FSDP2's backward hooks hang on the forward's outputs: a zero made of them runs every collective of the
        # backward, so this rank stays in step until the window's record makes every rank raise
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
        # ModelParallelStrategy restores after setup and never calls `load_optimizer_state_dict`: the metadata
        # returned here is what the loops are restored from next, so this rank's loader position goes in there.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        has_loader_states = _lightning.checkpoint_loader_states(checkpoint) is not None
        own = self._restore_token_mean_state(checkpoint, has_loader_states)
        if own is not None:
            _lightning.replace_checkpoint_loader_states(checkpoint, own)
        return checkpoint


TokenMeanModelParallelStrategy.register_strategies(StrategyRegistry)
