"""``TokenMeanDDPStrategy``: DDP whose optimizer step follows the mean loss over all valid items of the step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from token_mean import _lightning, _torch
from token_mean._arguments import check_parent_values, check_passed_through, named_parameters
from token_mean._core import Layout
from token_mean._ddp import InReduction, ShadowBackward, UnreducedParameters
from token_mean._hooks import TokenMeanStrategy
from token_mean._mode import Mode
from token_mean._record import World

# DDPStrategy keeps its own named arguments and hands the rest to DistributedDataParallel when it wraps the model
# (after launch); `module` and `device_ids` it fills in itself.
_PASSED_THROUGH = named_parameters(DDPStrategy.__init__) | named_parameters(
    DistributedDataParallel.__init__, leave_out=("module", "device_ids")
)

class TokenMeanDDPStrategy(TokenMeanStrategy, DDPStrategy):
    r"""DDP with gradient accumulation that optimizes the mean loss over all valid items of each optimizer step.

    Plain DDP with ``accumulate_grad_batches=K`` optimizes a mean of means: every micro-batch's mean loss is divided
    by K and DDP averages the P ranks, so an item in a small micro-batch weighs more than an item in a large one.
    This strategy rescales each micro-batch so that the optimizer sees exactly

    .. math:: g = \frac{1}{N} \sum_{r, j} \sum_{i \in \text{valid}(r, j)} \nabla \ell_i, \qquad N = \sum_{r, j} n_{r, j}

    over all ranks r and micro-batches j of the window, the gradient of the unpartitioned run. Empty micro-batches
    and ranks with no valid items contribute zero (never 0/0) and still take part in every collective (a rank with
    no batch at all is refused); a window with N = 0 on all ranks changes neither the parameters nor the optimizer
    state.

    The count is whatever the objective averages over: valid target tokens (the default, ``labels != -100``),
    examples (``count_fn=token_mean.count_examples``) or a sum of sample weights (a float). Choosing it is choosing
    the objective.

    Each window costs one all-reduce of a small record, started after the window's last forward and read on the host
    once, after its last backward: no host sync between a window's first forward and its last backward. Problems
    (a bad count, a NaN loss, ranks out of step) travel in that record, so every rank raises the same
    :class:`~token_mean.DenominatorError` before the optimizer step.

    Modes:
        ``"lookahead"`` (default) counts each window's batches before its first backward, with ``count_fn`` on the
        batches as the loader yields them: the next window's batches are read one per micro-batch (at most K held)
        and their counts ride in the current window's record. Each micro-batch's loss is scaled by K·P·n/N, so
        every hook, clipping and ``on_after_backward`` sees the final gradient scale, and ``training_step`` may
        return ``{"loss": token_mean_part, "aux_loss": term}``: the auxiliary term is averaged over the window's real
        micro-batches on all ranks instead. ``"deferred"`` reads nothing ahead: it counts each micro-batch after its
        forward (``count_fn`` or the ``"num_items"`` ``training_step`` returns), back-propagates local loss sums and
        corrects the scale inside DDP's gradient all-reduce of the window's last backward. Use it when the count is
        decided inside the model, when the loader must not be read ahead (it refills one buffer), or when K batches
        do not fit in host memory.

    Args:
        count_fn: ``count_fn(batch)`` gives the number of valid items of one micro-batch (an int, a float or a
            one-element tensor), for the batch ``training_step`` receives (with several training loaders, the
            combined batch). In lookahead mode it sees the batch before it is moved to the device. Defaults to
            :func:`~token_mean.count_valid_labels`.
        loss_reduction: what ``training_step`` returns: ``"mean"`` over the micro-batch's valid items (what
            ``F.cross_entropy(..., ignore_index=-100)`` gives) or their ``"sum"``.
        mode: ``"lookahead"`` or ``"deferred"``.
        pad_uneven_ranks: when the ranks' training loaders have different lengths (per-rank shards,
            :class:`~token_mean.ExactDistributedSampler`, streams that end at different batches), a rank that runs
            out repeats its last batch at weight zero until the longest rank is done (``is_filler_batch`` is True
            meanwhile), so all ranks run the same windows. With ``False``, different lengths are an error.
        \**kwargs: passed unchanged to :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``,
            ``process_group_backend``, ``timeout``, ``find_unused_parameters``, ...).

    Raises:
        ValueError: for an unknown ``mode`` or ``loss_reduction``, a ``count_fn`` that is not callable, or a
            ``ddp_comm_hook`` in deferred mode; at fit start, on every rank, when no ``count_fn`` was given and the
            module holds a Hugging Face causal LM whose loss shifts the labels (``count_shifted_labels`` or, for
            labels already shifted, ``count_valid_labels``: an explicit count is always used as given).
        TypeError: for an argument neither ``DDPStrategy`` nor ``DistributedDataParallel`` takes (a ``Trainer``
            argument such as ``accumulate_grad_batches`` goes to the ``Trainer``).

    After each window, :attr:`last_window` holds a :class:`~token_mean.WindowStats`.

    Example:
        >>> import lightning.pytorch as pl
        >>> strategy = TokenMeanDDPStrategy(start_method="fork", process_group_backend="gloo")
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, accumulate_grad_batches=4,
        ...                      logger=False, enable_checkpointing=False)
        >>> trainer = pl.Trainer(strategy="ddp_token_mean_fork", accelerator="cpu", devices=2, logger=False,
        ...                      enable_checkpointing=False)
    """

    strategy_name = "ddp_token_mean"

    @override
    def _check_kwargs(self, mode: Mode, kwargs: Mapping[str, Any]) -> None:
        check_passed_through(type(self).__name__, "DDPStrategy` or `DistributedDataParallel", kwargs, _PASSED_THROUGH)
        check_parent_values(type(self).__name__, kwargs)
        if mode == "deferred" and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with `mode='deferred'`, which installs its own gradient"
                " all-reduce hook to apply the global denominator. Use `mode='lookahead'` or remove `ddp_comm_hook`."
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Without this override the subclass would re-register DDP's own twelve names.
        for name, start_method in (
            ("ddp_token_mean", "popen"),
            ("ddp_token_mean_spawn", "spawn"),
            ("ddp_token_mean_fork", "fork"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Token-mean DDP strategy with `start_method` '{start_method}'",
                    start_method=start_method,
                )

    @override
    def _layout(self) -> Layout:
        model = self.model
        assert isinstance(model, DistributedDataParallel)  # `fit` wraps the model before `setup` asks
        # every rank holds its own batch: all of them share the denominator, over the default process group
        world = World(self.world_size, self.global_rank, self.root_device, distributed=self._distributed())
        return Layout(world, lambda: InReduction(model), [UnreducedParameters(model)], ShadowBackward(model),
                      lambda: _torch.rebuild_ddp_buckets(model))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # called on resume only (not for weights-only loading), on every rank, after the loops were restored
        super().load_optimizer_state_dict(checkpoint)
        own = self._restore_token_mean_state(checkpoint, _lightning.has_loader_states_to_load(self._trainer()))
        if own is not None:
            _lightning.set_loader_states_to_load(self._trainer(), own)


TokenMeanDDPStrategy.register_strategies(StrategyRegistry)
