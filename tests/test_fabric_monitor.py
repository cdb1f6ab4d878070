"""``FabricMonitor`` and ``TokenMeanLoss`` under Lightning Fabric: the per-window metrics through ``fabric.log_dict``,
the trace, the reference comparison and the plot; exact validation losses over ranks of different mask rates.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from _fabric import (
    data_rank,
    launched,
    setup,
    shifted_count,
    shifted_loss,
)
from _fabric_loop import (
    FABRICS,
    MISSES,
    K,
    ddp,
    every_rank_raises,
    monitor_data,
    one_message,
    trajectory,
    validation_batches,
)
from _harness import (
    EXACT,
    MODES,
    Batch,
    ListDataset,
    TokenNet,
    initial_state,
)
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch.utils.data import DataLoader

from token_mean import (
    ExactDistributedSampler,
    TokenMeanLoss,
    count_shifted_labels,
)
from token_mean._trace import TRACE_COLUMNS, read_trace
from token_mean.fabric import TokenMeanAccumulator
from token_mean.fabric_monitor import FabricMonitor
from token_mean.plot import main as plot_main

# ---------------------------------------------------------------------------------------------------------------
# 9. FabricMonitor: the per-window metrics through fabric.log_dict, the trace, the reference comparison, the plot
# ---------------------------------------------------------------------------------------------------------------

PREFIX = "denominator/"


def monitored(
    fabric: Fabric, data: list[list[Batch]], mode: str, record: Path | None, reference_trace: Path | None = None,
    on_divergence: str = "raise",
) -> dict[str, Any]:
    """The loop with ``FabricMonitor`` (and the Fabric's CSVLogger, flushed at the end on rank 0)."""
    model, optimizer = setup(fabric)
    monitor = FabricMonitor(record=record, reference=reference_trace, on_divergence=on_divergence)  # type: ignore[arg-type]
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=K, mode=mode, count_fn=count_shifted_labels,
                                       monitor=monitor)
    for batch in accumulator.batches(data[data_rank(fabric)]):
        with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
            accumulator.backward(shifted_loss(model, batch))
        if not accumulator.accumulating:
            accumulator.finish()
            optimizer.step()
            optimizer.zero_grad()
    monitor.close()
    for logger in fabric.loggers:
        logger.finalize("success")
    divergence = monitor.first_divergence
    return {"first_divergence": None if divergence is None else (divergence.step, divergence.quantity)}


def logged_rows(root: Path) -> list[dict[str, float]]:
    """The CSVLogger's metrics, one row per logged window, in step order."""
    with (root / "fabric" / "version_0" / "metrics.csv").open() as file:
        rows = [{key: float(value) for key, value in row.items() if value != ""} for row in csv.DictReader(file)]
    return sorted(rows, key=lambda row: row["step"])


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("layout", "mode", "traced"), [
    ("ddp", "lookahead", True),
    ("ddp", "deferred", True),
    ("fsdp2", "lookahead", False),
    ("fsdp2", "lookahead", True),
], ids=["ddp-lookahead", "ddp-deferred", "fsdp2-lookahead-logged", "fsdp2-lookahead-traced"])
def test_the_monitor_logs_and_traces_the_reference(tmp_path: Path, layout: str, mode: str, traced: bool) -> None:
    """Every window through ``fabric.log_dict`` (step = windows before it): N, each rank's count (min, max, mean),
    the window's exact token-mean loss, which equal the reference's; the trace's rows (``read_trace``) hold the same N
    and loss, the gradient norm before the update and the parameter norm after it, also the reference's (under
    FSDP2 also without a trace, which takes no fingerprint). Control: the reference's own windows differ from each
    other (3 distinct N and losses), so a trace of the wrong window or a mean of means would not match."""
    data = monitor_data()
    expected = trajectory(data)
    assert len({row["global_count"] for row in expected}) == len({row["loss"] for row in expected}) == 3
    fabric = FABRICS[layout](loggers=CSVLogger(root_dir=tmp_path, name="fabric", version=0))
    launched(fabric, monitored, data, mode, tmp_path / "trace.csv" if traced else None)
    rows = logged_rows(tmp_path)
    assert [row["step"] for row in rows] == [0.0, 1.0, 2.0]
    for row, window in zip(rows, expected, strict=True):
        assert row[f"{PREFIX}global_count"] == window["global_count"]
        assert row[f"{PREFIX}rank_count_min"] == min(window["rank_counts"])
        assert row[f"{PREFIX}rank_count_max"] == max(window["rank_counts"])
        assert row[f"{PREFIX}rank_count_mean"] == window["global_count"] / 2
        assert row[f"{PREFIX}loss"] == pytest.approx(window["loss"], rel=EXACT)
    if not traced:
        assert not (tmp_path / "trace.csv").exists()
        return
    with (tmp_path / "trace.csv").open() as file:
        assert next(csv.reader(file)) == list(TRACE_COLUMNS)
    trace = read_trace(tmp_path / "trace.csv")
    assert sorted(trace) == [0, 1, 2]
    for step, window in enumerate(expected):
        row = trace[step]
        assert row["global_count"] == window["global_count"]
        for column in ("loss", "grad_norm", "param_norm"):
            assert row[column] == pytest.approx(window[column], rel=EXACT), column


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_a_replay_against_the_fabric_trace(tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A second run with ``FabricMonitor(reference=trace, on_divergence="raise")`` on the same data passes; one on
    other data (window 1 has one target fewer) raises the same DivergenceError on both ranks at step 1, naming
    ``global_count``; ``python -m token_mean.plot`` (``main`` in-process) reads the Fabric traces and finds the same
    first divergent step. Control: the same-data replay, which must not diverge. The message names the Fabric
    front end's monitor (``DenominatorMonitor`` is the Trainer's)."""
    reference_trace, same, other = tmp_path / "reference.csv", tmp_path / "same.csv", tmp_path / "other.csv"
    launched(ddp(), monitored, monitor_data(), mode, reference_trace)
    assert launched(ddp(), monitored, monitor_data(), mode, same, reference_trace) == {"first_divergence": None}
    message = one_message(every_rank_raises(ddp(), tmp_path / "outcomes", monitored, monitor_data(other=True), mode,
                                            None, reference_trace))
    assert message.startswith("DivergenceError: FabricMonitor: step 1 diverged from the reference trace"), message
    assert "global_count is" in message, message
    logged = launched(ddp(), monitored, monitor_data(other=True), mode, other, reference_trace, "log")
    assert logged == {"first_divergence": (1, "global_count")}
    capsys.readouterr()
    assert plot_main([str(same), str(reference_trace), "-o", str(tmp_path / "same.png")]) == 0
    assert plot_main([str(other), str(reference_trace), "-o", str(tmp_path / "other.png")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{tmp_path / 'same.png'}: no divergent step in 3 common steps (atol 1e-06, rtol 0.0001).",
                       f"{tmp_path / 'other.png'}: first divergent step 1 (global_count)."]
    assert (tmp_path / "other.png").read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------------------------------------------------------
# 10. TokenMeanLoss: exact validation under Fabric
# ---------------------------------------------------------------------------------------------------------------


def validate(fabric: Fabric, batches: list[Batch], group: str) -> dict[str, float]:
    """LitGPT's ``validate`` with a ``TokenMeanLoss`` beside its ``losses``; ``group``: ``"data-parallel"`` passes
    the mesh's data-parallel group as ``process_group`` (the default group under DDP), ``"default"`` passes none."""
    model, _ = setup(fabric)
    mesh = getattr(fabric.strategy, "_device_mesh", None)
    replicas, rank = (fabric.world_size, fabric.global_rank) if mesh is None else (
        mesh["data_parallel"].size(), mesh["data_parallel"].get_local_rank())
    dataset = ListDataset(batches)
    sampler = ExactDistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=None, sampler=sampler))
    process_group = mesh["data_parallel"].get_group() if mesh is not None and group == "data-parallel" else None
    metric = TokenMeanLoss(process_group=process_group).to(fabric.device)
    losses = []
    model.eval()
    with torch.no_grad():
        for batch in loader:
            loss = shifted_loss(model, batch)
            metric.update(loss, shifted_count(batch))
            losses.append(loss)
    value = float(metric.compute())
    with metric.sync_context():
        count = float(metric.count)
    mean_of_means = torch.stack(losses).mean()
    return {"metric": value, "count": count, "litgpt": float(mean_of_means),
            "litgpt_all_ranks": float(fabric.all_reduce(mean_of_means, reduce_op="mean"))}


def validation_reference(batches: list[Batch]) -> tuple[float, float]:
    """The float64 token mean over every validation batch at the initial parameters, and N."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    with torch.no_grad():
        total = sum(shifted_count(batch) for batch in batches)
        return float(sum(shifted_loss(net, batch, "sum") for batch in batches) / total), float(total)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("layout", "group"), [
    ("ddp", "data-parallel"), ("fsdp2xtp", "data-parallel"), ("fsdp2xtp", "default"),
])
def test_token_mean_loss_validates_exactly(layout: str, group: str) -> None:
    """Uneven ranks (3 batches and 2, through ``ExactDistributedSampler``): ``compute()`` is the float64 token mean
    over all validation batches and the synced count is N. Control: LitGPT's ``losses.mean()`` (rank 0's, and its
    mean over ranks) misses. Under FSDP2 × TP on 2 × 2 the tensor-parallel peers evaluate the same batches: without
    the data-parallel ``process_group`` the metric sums them twice and its count is 2N (the wrong group misses).
    The mean survives it only because both peers add bit-identical sums."""
    batches = validation_batches()
    expected, total = validation_reference(batches)
    result = launched(FABRICS[layout](), validate, batches, group)
    assert result["metric"] == pytest.approx(expected, rel=EXACT)
    assert abs(result["litgpt"] - expected) > MISSES * expected
    assert abs(result["litgpt_all_ranks"] - expected) > MISSES * expected
    over_count = 2 if group == "default" else 1
    assert result["count"] == over_count * total
