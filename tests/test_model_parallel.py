"""TokenMeanModelParallelStrategy against the plain-torch unpartitioned reference (float64, relative 1e-12).

The harness's TokenNet is parallelized in ``configure_model`` (``_mesh.MeshModule``): ``fully_shard`` over the
data-parallel mesh dimension, and on a tensor-parallel dimension ``ColwiseParallel`` on ``hidden`` and
``RowwiseParallel`` on ``out``. Each data-parallel rank reads its own ragged batches; the ranks of one
tensor-parallel group read the same. Every case also runs with plain ``ModelParallelStrategy``, which must miss.
Workers are forked (``_mesh.forked``): Lightning gives ``ModelParallelStrategy`` only its subprocess launcher, which
``test_subprocess_launcher`` runs once.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _harness import EXACT, MODES, constant, empty_like, fit, ragged_batches, reference, relative_error
from _jobs import run_bounded
from _mesh import MeshModule, ResumableMeshModule, forked
from _ranks import raises_everywhere
from _resume_helpers import SaveAtBatch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import Tensor

from token_mean import DenominatorError, TokenMeanModelParallelStrategy

GLOO: dict[str, Any] = {"process_group_backend": "gloo"}

# (data-parallel size, tensor-parallel size, K): FSDP2 alone, FSDP2 × TP, and TP alone (where K = 1 is one batch
# per step, which plain ModelParallelStrategy gets right too)
CASES = [(2, 1, 1), (2, 1, 3), (2, 2, 1), (2, 2, 3), (1, 2, 3)]
CASE_IDS = ["fsdp2-K1", "fsdp2-K3", "fsdp2xtp-K1", "fsdp2xtp-K3", "tp-K3"]


def strategy_for(mode: str, data_parallel: int, tensor_parallel: int, **kwargs: Any) -> ModelParallelStrategy:
    sizes = {"data_parallel_size": data_parallel, "tensor_parallel_size": tensor_parallel}
    if mode == "plain":
        return forked(ModelParallelStrategy)(**sizes, **GLOO)
    return forked(TokenMeanModelParallelStrategy)(mode=mode, **sizes, **GLOO, **kwargs)


def ragged_with_empty(ranks: int, batches: int, seed: int) -> list[list[dict[str, Tensor]]]:
    """Ragged per-rank batches with one fully masked micro-batch on the first rank."""
    data = ragged_batches(ranks, batches, seed=seed)
    data[0][1] = empty_like(data[0][1])
    return data


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize(("data_parallel", "tensor_parallel", "k"), CASES, ids=CASE_IDS)
def test_matches_unpartitioned_reference(
    tmp_path: Path, data_parallel: int, tensor_parallel: int, mode: str, k: int
) -> None:
    data = ragged_with_empty(data_parallel, 7, seed=data_parallel + 10 * tensor_parallel)  # K = 3: a partial window
    strategy = strategy_for(mode, data_parallel, tensor_parallel)
    devices = data_parallel * tensor_parallel
    params, windows = fit(MeshModule(data), strategy, tmp_path, devices, accumulate_grad_batches=k)
    expected, counts = reference(data, constant(k))
    error = relative_error(params, expected)
    if mode == "plain":
        # a mean of means matches only when every micro-batch of a step holds the same number of tokens
        assert error > 1e-6, "plain ModelParallelStrategy matched the token mean: the test could not fail"
        return
    assert error < EXACT, f"{mode}: relative parameter error {error:.3e}"
    assert [w["global_count"] for w in windows] == counts  # summed over data-parallel ranks only
    assert all(len(w["rank_counts"]) == data_parallel for w in windows)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_uneven_data_parallel_ranks(tmp_path: Path, mode: str) -> None:
    """Data-parallel rank 1 runs out after 4 of rank 0's 7 batches and joins the last windows at weight zero."""
    data = ragged_batches(2, 7, seed=21)
    data[1] = data[1][:4]
    params, windows = fit(MeshModule(data), strategy_for(mode, 2, 1), tmp_path, accumulate_grad_batches=3)
    expected, counts = reference(data, constant(3))
    assert relative_error(params, expected) < EXACT
    assert [w["global_count"] for w in windows] == counts
    assert windows[2]["rank_counts"][1] == 0.0  # the third window (batch 6) is all filler on rank 1


# torch before 2.10 clips DTensor gradients by max_norm / (‖g‖ + c·1e-6) with c ≠ 1: `clip_grad_norm_` adds its
# 1e-6 to the norm while it is still a partial (`_NormPartial`) on each rank, before the reduction. On this 2 × 2
# mesh that misses the unsharded clip by 1.5e-7 relative, plain torch without the package alike (probed on 2.6 to
# 2.9); from 2.10 on it is exact. The test's control (clipping moves the result by more than 1e-3) still holds.
CLIPPED_EXACT = EXACT if torch.__version__ >= (2, 10) else 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_clipping_by_norm_acts_on_the_final_gradient(tmp_path: Path, mode: str) -> None:
    """Lightning clips FSDP2 × TP's DTensor gradients; the result equals clipping the reference gradient."""
    data = ragged_batches(2, 6, seed=8)
    value = 0.05
    params, _ = fit(
        MeshModule(data),
        strategy_for(mode, 2, 2),
        tmp_path,
        4,
        accumulate_grad_batches=3,
        gradient_clip_val=value,
    )
    expected, _ = reference(data, constant(3), clip_norm=value)
    unclipped, _ = reference(data, constant(3))
    assert relative_error(unclipped, expected) > 1e-3, "the threshold did not clip: the test could not fail"
    assert relative_error(params, expected) < CLIPPED_EXACT


# ---------------------------------------------------------------------------------------------------------------
# tensor-parallel ranks that count differently: every rank raises
# ---------------------------------------------------------------------------------------------------------------


class RecordingStrategy(TokenMeanModelParallelStrategy):
    """Each rank writes the error it raised, to show that every rank raised and with which message."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def training_step(self, *args: Any, **kwargs: Any) -> Any:  # lookahead's first window raises here
        return self._recording(super().training_step, *args, **kwargs)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:  # where a window's record is read
        return self._recording(super().optimizer_step, *args, **kwargs)

    def _recording(self, hook: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except DenominatorError as error:
            (self.path / f"error-{self.global_rank}.txt").write_text(str(error))
            # the launcher stops the others as soon as one worker exits: wait until every rank has written
            dist.monitored_barrier(timeout=timedelta(seconds=20))
            raise


def count_plus_tensor_parallel_rank(batch: dict[str, Tensor]) -> Tensor:
    """A count that differs between the two ranks of each tensor-parallel group (global rank = 2·dp + tp)."""
    return (batch["labels"] != -100).sum() + dist.get_rank() % 2


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_count_disagreement_raises_on_every_rank(tmp_path: Path, mode: str) -> None:
    strategy = forked(RecordingStrategy)(
        tmp_path,
        mode=mode,
        count_fn=count_plus_tensor_parallel_rank,
        data_parallel_size=2,
        tensor_parallel_size=2,
        **GLOO,
    )
    with pytest.raises(Exception, match="DenominatorError"):
        fit(MeshModule(ragged_batches(2, 4)), strategy, tmp_path, 4, accumulate_grad_batches=2)
    errors = [(tmp_path / f"error-{rank}.txt").read_text() for rank in range(4)]
    assert len(set(errors)) == 1, "the ranks raised different errors"
    assert "ranks 0, 1: the ranks of one tensor-parallel group" in errors[0]
    assert "optimizer step 0 " in errors[0] and "Fix:" in errors[0]


# ---------------------------------------------------------------------------------------------------------------
# resume from Lightning's distributed checkpoint, set-up errors, the registered name, the real launcher
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_resume_from_distributed_checkpoint(tmp_path: Path, mode: str) -> None:
    """A mid-epoch checkpoint (a folder of shards) resumes each data-parallel rank at its own loader position."""
    data = ragged_batches(2, 7, seed=31)
    data[1] = data[1][:5]  # rank 1 runs out in the second epoch's last window: its exhausted state is restored too
    checkpoint = tmp_path / "mid-epoch.ckpt"
    kwargs: dict[str, Any] = {"accumulate_grad_batches": 3, "max_epochs": 2}
    save = SaveAtBatch(checkpoint, batch_idx=2)  # after optimizer step 1
    full, _ = fit(ResumableMeshModule(data), strategy_for(mode, 2, 1), tmp_path / "full", callbacks=[save], **kwargs)
    assert checkpoint.is_dir(), "ModelParallelStrategy did not write a distributed checkpoint"
    resumed, windows = fit(
        ResumableMeshModule(data), strategy_for(mode, 2, 1), tmp_path / "resumed", ckpt_path=checkpoint, **kwargs
    )
    expected, counts = reference(data, constant(3), epochs=2)
    assert relative_error(full, expected) < EXACT
    assert relative_error(resumed, expected) < EXACT
    assert [w["global_count"] for w in windows] == counts[1:], "the resumed run trained on other batches"


# torch 2.8 replaced FSDP2's `set_reduce_scatter_divide_factor` (a PREMUL_SUM reduce op in 2.6 and 2.7, which keeps
# no factor to read) with `set_gradient_divide_factor`, whose factor each parameter group keeps
READABLE_FACTOR = torch.__version__ >= (2, 8)


class DividedModule(MeshModule):
    """torchtitan's setup: FSDP2 sums the gradients (factor 1.0), or divides by ``factors[i]`` module by module."""

    def __init__(self, data: Any, factors: tuple[float, ...] = (1.0,)) -> None:
        super().__init__(data)
        self.factors = factors

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if len(self.factors) > 1:  # the output layer sharded apart, with its own factor
            fully_shard(self.net.out, mesh=self.device_mesh["data_parallel"])
            self.net.out.set_gradient_divide_factor(self.factors[1])
        super().configure_model()
        getattr(self.net, "set_gradient_divide_factor" if READABLE_FACTOR else "set_reduce_scatter_divide_factor")(
            self.factors[0]
        )


@pytest.mark.distributed
@pytest.mark.skipif(not READABLE_FACTOR, reason="torch < 2.8 keeps no readable divide factor (refused, below)")
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_gradient_divide_factor_matches_reference(tmp_path: Path, mode: str, factor: float) -> None:
    """A reduction that sums (factor 1, torchtitan's) or divides by another factor than P: the scale is factor·n/N."""
    data = ragged_with_empty(2, 5, seed=3)
    params, windows = fit(
        DividedModule(data, (factor,)), strategy_for(mode, 2, 1), tmp_path, 2, accumulate_grad_batches=2
    )
    expected, counts = reference(data, constant(2))
    error = relative_error(params, expected)
    if mode == "plain":
        assert error > 1e-6, "plain ModelParallelStrategy matched the token mean: the test could not fail"
        return
    assert error < EXACT, f"{mode}: relative parameter error {error:.3e}"
    assert [w["global_count"] for w in windows] == counts


@pytest.mark.distributed
@pytest.mark.skipif(not READABLE_FACTOR, reason="torch < 2.8 keeps no readable divide factor")
def test_different_divide_factors_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(
        Exception,
        match=r"the FSDP2 modules divide by different factors \(`net` by 1, `net.out` by 2\)",
    ):
        fit(DividedModule(ragged_batches(2, 2), (1.0, 2.0)), strategy_for("lookahead", 2, 1), tmp_path)


@pytest.mark.distributed
@pytest.mark.skipif(not READABLE_FACTOR, reason="torch < 2.8 keeps no readable divide factor")
@pytest.mark.parametrize("factor", [0.0, -2.0])
def test_a_divide_factor_that_cannot_be_undone_is_an_error(tmp_path: Path, factor: float) -> None:
    with pytest.raises(Exception, match=rf"`set_gradient_divide_factor\({factor!r}\)` on `net`: a reduced gradient"):
        fit(DividedModule(ragged_batches(2, 2), (factor,)), strategy_for("lookahead", 2, 1), tmp_path)


@pytest.mark.distributed
@pytest.mark.skipif(READABLE_FACTOR, reason="torch >= 2.8 keeps the factor, which is accepted (above)")
def test_unreadable_divide_factor_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"set_reduce_scatter_divide_factor\(\.\.\.\)`, whose factor torch < 2.8"):
        fit(DividedModule(ragged_batches(2, 2)), strategy_for("lookahead", 2, 1), tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulate_grad_batches": 2}, r"a `Trainer` argument: pass `accumulate_grad_batches` to the `Trainer`"),
        ({"find_unused_parameters": True}, r"argument `find_unused_parameters=True`.*`tensor_parallel_size`"),
    ],
)
def test_misplaced_arguments_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        TokenMeanModelParallelStrategy(**kwargs)


@pytest.mark.parametrize("kwargs", [{"data_parallel_size": 0}, {"tensor_parallel_size": "2"}, {"timeout": 5.0}])
def test_parent_values_are_checked_at_construction(kwargs: dict[str, Any]) -> None:
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=rf"`{name}` must be .*, got {re.escape(repr(value))}\.$"):
        TokenMeanModelParallelStrategy(**kwargs)


def test_registered_name() -> None:
    trainer = pl.Trainer(
        strategy="model_parallel_token_mean", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False
    )
    assert type(trainer.strategy) is TokenMeanModelParallelStrategy
    assert "model_parallel_token_mean" in StrategyRegistry
    assert pl.Trainer(strategy="ddp", accelerator="cpu", devices=2).strategy.__class__.__name__ == "DDPStrategy"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_subprocess_launcher(tmp_path: Path) -> None:
    """What users run: Lightning's subprocess launcher re-runs the script (FSDP2 over 2 data-parallel ranks)."""
    script = Path(__file__).parent / "scripts" / "model_parallel_token_mean.py"
    done = run_bounded([sys.executable, str(script), str(tmp_path)], timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    params = {k.removeprefix("net."): v for k, v in params.items()}
    windows = json.loads((tmp_path / "windows.json").read_text())
    sys.path.insert(0, str(script.parent))
    from model_parallel_token_mean import ACCUMULATE, data

    expected, counts = reference(data(), constant(ACCUMULATE))
    assert relative_error(params, expected) < EXACT
    assert [w["global_count"] for w in windows] == counts


def nan_loss_on_rank_one(module: Any, batch: dict[str, Tensor], loss: Tensor) -> Any:
    return loss * float("nan") if dist.get_rank() == 1 else loss


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_nan_loss_raises_on_every_rank(tmp_path: Path, mode: str) -> None:
    strategy = forked(RecordingStrategy)(tmp_path, mode=mode, data_parallel_size=2, tensor_parallel_size=1, **GLOO)
    module = MeshModule(ragged_batches(2, 4), output_fn=nan_loss_on_rank_one)
    with pytest.raises(Exception, match="DenominatorError"):
        fit(module, strategy, tmp_path, accumulate_grad_batches=2)
    first, second = [(tmp_path / f"error-{rank}.txt").read_text() for rank in range(2)]
    assert first == second, "the ranks raised different errors"
    assert "rank 1: the loss of a micro-batch that the count says holds valid items is NaN" in first


def no_loss_on_rank_one(module: Any, batch: dict[str, Tensor], loss: Tensor) -> Any:
    return {"logits": loss.detach()} if dist.get_rank() == 1 else loss


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("data_parallel", "tensor_parallel"), [(2, 1), (2, 2)], ids=["fsdp2", "fsdp2xtp"])
def test_missing_loss_raises_on_every_rank(tmp_path: Path, mode: str, data_parallel: int, tensor_parallel: int) -> None:
    """A rank whose `training_step` returns no loss back-propagates a zero made of its sharded modules' outputs, so
    FSDP2's (and tensor parallelism's) backward collectives run on every rank, and every rank raises the same error
    at the window's end, well before the 30 s process-group timeout (no rank is left waiting for it)."""
    strategy = strategy_for(mode, data_parallel, tensor_parallel, timeout=timedelta(seconds=30))
    module = MeshModule(ragged_batches(data_parallel, 4), output_fn=no_loss_on_rank_one)
    devices = data_parallel * tensor_parallel
    started = time.monotonic()
    errors = raises_everywhere(
        tmp_path, lambda: fit(module, strategy, tmp_path, devices, accumulate_grad_batches=2), ranks=devices
    )
    assert time.monotonic() - started < 25, "a rank waited for the process group's timeout"
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: ") and "returned no loss" in errors[0], errors[0]
    # the data-parallel rank of global rank 1 (under 2 x 2, global rank 1 is tensor-parallel rank 1 of group 0)
    assert re.search(r"(token_mean: |\n  Also: )ranks? [01]\b.*`training_step` returned no loss", errors[0]), errors[0]
