"""The objective audit under FSDP2 and tensor parallelism (Lightning's ``ModelParallelStrategy`` mesh).

The replay runs through the sharded module itself (FSDP2 all-gathers, tensor-parallel collectives) and takes the
gradient of the window's objective without writing ``.grad``; each rank compares the part of it its ``.grad`` holds.
As in ``tests/test_audit.py``: plain ``ModelParallelStrategy`` on ragged data is flagged at the first window with
the error the float64 reference computes (``test_audit``'s reference, which imports nothing from the package), the
token-mean strategy and the Fabric accumulator never are, and the parameters are those of the run without audit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from _harness import MODES, Batch, empty_like, fit, ragged_batches
from _mesh import MeshModule
from test_audit import (
    NEVER_FLAGGED,
    AuditsWritten,
    DropoutModule,
    MetricsAndRng,
    accumulator_audited,
    assert_flagged,
    assert_never_flagged,
    assert_unchanged,
    audit_error,
    audited_fit,
    first_window,
    litgpt_case,
    litgpt_loop_audited,
    mean_of_means_gradient,
    nonempty,
    token_mean_gradient,
)
from test_model_parallel import strategy_for

from token_mean import Audit, DenominatorMonitor

MESHES = [(2, 1), (2, 2)]
MESH_IDS = ["fsdp2", "fsdp2xtp"]


def uneven_with_empty(seed: int) -> list[list[Batch]]:
    """Ragged data-parallel ranks: rank 1 runs out after 5 of rank 0's 7 batches (fillers), and rank 0's second
    micro-batch has no valid target (every micro-batch still runs the sharded module's collectives)."""
    data = ragged_batches(2, 7, seed=seed)
    data[1] = data[1][:5]
    data[0][1] = empty_like(data[0][1])
    return data


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_token_mean_is_never_flagged_and_unchanged(tmp_path: Path, mode: str) -> None:
    """FSDP2 over 2 data-parallel ranks, K = 3, every window audited."""
    data = uneven_with_empty(seed=251)
    plain, _ = fit(MeshModule(data), strategy_for(mode, 2, 1), tmp_path / "off", accumulate_grad_batches=3)
    params, audits = audited_fit(MeshModule(data), strategy_for(mode, 2, 1), tmp_path / "on",
                                 accumulate_grad_batches=3)
    assert_never_flagged(audits, 3)
    assert_unchanged(params, plain)


class PerLayerDropoutModule(MeshModule):
    """``fully_shard`` on each layer, then on the net (the layers reshard after forward: their backward all-gathers
    again), dropout between the layers and ``self.log`` of every loss (``test_audit.DropoutModule``'s step)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net.hidden, mesh=mesh)
        fully_shard(self.net.out, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return DropoutModule.training_step(self, batch, batch_idx)  # type: ignore[arg-type]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_per_layer_fsdp2_with_dropout_and_logged_metrics(tmp_path: Path) -> None:
    """The trajectory, the logged metrics and the RNG stream after the fit are those of the run without audit."""
    data = uneven_with_empty(seed=255)
    runs = {}
    for name, every in (("off", None), ("on", 1)):
        out = tmp_path / name
        out.mkdir()
        pl.seed_everything(7)
        monitor = DenominatorMonitor(audit_every=every, on_audit_failure="raise")
        params, _ = fit(PerLayerDropoutModule(data), strategy_for("lookahead", 2, 1), out, accumulate_grad_batches=3,
                        callbacks=[monitor, MetricsAndRng(out), AuditsWritten(monitor, out)])
        runs[name] = params, json.loads((out / "metrics.json").read_text())
    assert_unchanged(runs["on"][0], runs["off"][0])
    assert runs["on"][1] == runs["off"][1]
    audits = [Audit(**a) for a in json.loads((tmp_path / "on" / "audits0.json").read_text())]
    assert len(audits) == 3 and all(a.passed and a.error is not None and a.error < NEVER_FLAGGED for a in audits)


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("data_parallel", "tensor_parallel"), MESHES, ids=MESH_IDS)
def test_plain_model_parallel_on_ragged_ranks_is_flagged(
    tmp_path: Path, data_parallel: int, tensor_parallel: int
) -> None:
    """A mean of means (Lightning divides by K, FSDP2 averages the ranks): the figure is the reference's."""
    data = nonempty(ragged_batches(2, 6, seed=252))
    window = first_window(data, 3)
    expected = audit_error([mean_of_means_gradient(window, 3)] * 2, token_mean_gradient(window))
    devices = data_parallel * tensor_parallel
    _, audits = audited_fit(MeshModule(data), strategy_for("plain", data_parallel, tensor_parallel), tmp_path,
                            devices, accumulate_grad_batches=3)
    assert_flagged(audits, expected)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_tensor_parallel_token_mean_is_never_flagged_and_unchanged(tmp_path: Path) -> None:
    """FSDP2 × tensor parallelism on a 2 × 2 mesh: the tensor-parallel ranks hold column and row shards of the
    layers and a replicated bias, each rank compares its own part."""
    data = uneven_with_empty(seed=253)
    plain, _ = fit(MeshModule(data), strategy_for("deferred", 2, 2), tmp_path / "off", 4, accumulate_grad_batches=3)
    params, audits = audited_fit(MeshModule(data), strategy_for("deferred", 2, 2), tmp_path / "on", 4,
                                 accumulate_grad_batches=3)
    assert_never_flagged(audits, 3)
    assert_unchanged(params, plain)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("data_parallel", "tensor_parallel", "mode"), [(2, 1, "lookahead"), (2, 2, "deferred")],
                         ids=["fsdp2-lookahead", "fsdp2xtp-deferred"])
def test_fabric_model_parallel_accumulator_is_never_flagged_and_unchanged(
    data_parallel: int, tensor_parallel: int, mode: str
) -> None:
    """Fabric's ``ModelParallelStrategy`` with ``TokenMeanAccumulator``, K = 3, fillers: every window audited in
    ``finish()``, its figure on the stats."""
    from _fabric import fabric_for, launched

    data = ragged_batches(2, 7, seed=254)
    data[1] = data[1][:5]
    devices = data_parallel * tensor_parallel
    off = launched(fabric_for("fsdp", devices, tensor_parallel), accumulator_audited, data, mode, None)
    on = launched(fabric_for("fsdp", devices, tensor_parallel), accumulator_audited, data, mode, 1)
    assert off["errors"] == [None] * 3 and off["audits"] == []
    assert len(on["errors"]) == 3 and all(e is not None and e < NEVER_FLAGGED for e in on["errors"]), on["errors"]
    assert_unchanged(on["params"], off["params"])


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("data_parallel", "tensor_parallel"), MESHES, ids=MESH_IDS)
def test_fabric_litgpt_loop_on_model_parallel_is_flagged(data_parallel: int, tensor_parallel: int) -> None:
    """LitGPT's ``fabric.backward(loss / K)`` loop under Fabric's ``ModelParallelStrategy``, audited by
    ``FabricMonitor`` alone: the figure is the reference's."""
    from _fabric import fabric_for, launched

    data, expected = litgpt_case(256)
    devices = data_parallel * tensor_parallel
    audits = [Audit(**a) for a in launched(fabric_for("fsdp", devices, tensor_parallel), litgpt_loop_audited, data, 2)]
    assert [a.step for a in audits] == [0, 1]
    assert_flagged([audits], expected)


def test_sharded_model_without_a_data_parallel_mesh_is_refused(tmp_path: Path) -> None:
    """Without Lightning's mesh the audit cannot tell which ranks' items add up: refused, saying what to do."""
    import torch.distributed as dist
    from _harness import TokenNet
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from token_mean._audit import Auditor, Objective
    from token_mean._layout import World

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    net = fully_shard(TokenNet(), mesh=mesh["data_parallel"])
    objective = Objective(lambda module, micro_batch: (None, None), lambda batch: 0, "mean")
    auditor = Auditor(2, "raise", None, "DenominatorMonitor")
    with pytest.raises(ValueError, match=(
        r"^`DenominatorMonitor\(audit_every=2\)` cannot audit this model: its parameters are sharded \(FSDP2 or"
        r" tensor parallelism\) and the run has no device mesh with a 'data_parallel' dimension .* run it under"
        r" `ModelParallelStrategy`\. Remove `audit_every`"
    )):
        auditor.prepare(net, objective, World.single())
    auditor.prepare(net, objective, World.single(), mesh=mesh)  # with Lightning's mesh: accepted
