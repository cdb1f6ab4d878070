"""Smoke tests: each benchmark script runs with its ``--quick`` settings, exits 0 and writes the expected JSON.

Real subprocesses (the scripts fork their own gloo workers); no timing is asserted, only fidelity, which is exact.
The cost counts themselves are pinned in ``test_cost.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _gpu import cuda_devices
from _jobs import run_bounded
from _old_torch import FSDP2_RUNS_ON_CPU, NO_FSDP2_ON_CPU

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "results"
EXACT = 1e-12
pytestmark = pytest.mark.script  # `make test-scripts`; CI runs it beside `make test`


def run_script(name: str, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    markdown = tmp_path / f"{name}.md"
    completed = run_bounded(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--json", str(out), "--markdown", str(markdown),
         *args]
    )
    assert completed.returncode == 0, f"{name}.py exited {completed.returncode}:\n{completed.stderr[-3000:]}"
    assert markdown.read_text().count("|") > 10, "no markdown table written"
    payload: dict[str, Any] = json.loads(out.read_text())
    assert_environment(payload, name)
    return payload


def assert_environment(payload: dict[str, Any], name: str) -> None:
    environment = payload["environment"]
    assert isinstance(environment, dict)
    for key in ("date", "cpu", "cores", "torch", "lightning", "configuration"):
        assert key in environment, f"{name}.json lacks environment[{key!r}]"


@pytest.mark.distributed
@pytest.mark.slow
def test_fidelity_quick(tmp_path: Path) -> None:
    payload = run_script("fidelity", tmp_path)
    cells = payload["cells"]
    assert isinstance(cells, list) and cells
    assert {c["method"] for c in cells} == {"plain", "lookahead", "deferred"}
    assert {c["dtype"] for c in cells} == {"float64", "float32"}
    exact = [c for c in cells if c["method"] != "plain" and c["dtype"] == "float64"]
    assert exact and all(c["relative_error"] <= EXACT for c in exact), exact
    ragged_plain = [c for c in cells if c["method"] == "plain" and c["dtype"] == "float64" and c["raggedness"] == "sft"]
    # plain DDP's mean of means must miss a ragged cell, or the benchmark could not tell the methods apart
    assert ragged_plain and all(c["relative_error"] > 1e-6 for c in ragged_plain), ragged_plain
    assert payload["pass"] is True


@pytest.mark.distributed
@pytest.mark.slow
def test_audit_quick(tmp_path: Path) -> None:
    payload = run_script("audit", tmp_path)
    assert {r["model"] for r in payload["rows"]} == {"tiny", "tinylm"}
    for key in ("ratio_tiny", "ratio_tinylm", "cpu_ratio_tiny", "cpu_ratio_tinylm"):
        assert isinstance(payload[key], float) and payload[key] > 0, (key, payload[key])
    assert len(payload["runs"]) == 8  # 2 models x 2 repetitions x (off, on)


@pytest.mark.distributed
@pytest.mark.slow
def test_count_check_quick(tmp_path: Path) -> None:
    payload = run_script("count_check", tmp_path)
    assert [r["model"] for r in payload["rows"]] == ["tiny", "tinylm"]
    assert len(payload["runs"]) == 8  # 2 models x 2 repetitions x (off, on)
    assert all(r["steady_window_s"] > 0 for r in payload["rows"])


@pytest.mark.distributed
@pytest.mark.slow
def test_overhead_quick(tmp_path: Path) -> None:
    payload = run_script("overhead", tmp_path)
    for key in ("ratio_lookahead", "ratio_deferred"):
        value = payload[key]
        assert isinstance(value, float) and value > 0, (key, value)
    rows = payload["rows"]
    assert isinstance(rows, list)
    methods = ("plain", "lookahead", "deferred")
    expected = {(model, k, method) for model in ("tiny", "tinylm") for k in (1, 4) for method in methods}
    assert {(r["model"], r["accumulate"], r["method"]) for r in rows} == expected
    assert all(r["peak_rss_mib"] > 0 for r in rows)
    collectives = payload["collectives_gloo_2proc"]
    assert isinstance(collectives, dict) and collectives["all_reduce_record_us"] > 0
    assert all(r["exchange_ms_per_step"] == 0 for r in rows if r["method"] == "plain")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not FSDP2_RUNS_ON_CPU, reason=NO_FSDP2_ON_CPU)
def test_model_parallel_quick(tmp_path: Path) -> None:
    payload = run_script("model_parallel", tmp_path)
    for key in ("ratio_lookahead", "ratio_deferred"):
        value = payload[key]
        assert isinstance(value, float) and value > 0, (key, value)


@pytest.mark.distributed
@pytest.mark.slow
def test_cost_quick(tmp_path: Path) -> None:
    payload = run_script("cost", tmp_path)
    rows = payload["rows"]
    assert {(r["loader"], r["method"], r["monitor"]) for r in rows} == {
        (loader, method, monitor) for loader in ("sized", "unsized") for method in ("plain", "lookahead", "deferred")
        for monitor in (False, True)
    }
    # what test_cost.py pins in full: no host read of device data inside a window
    assert all(r["reads_in_window"] == r["reads_in_window_host_count"] for r in rows if r["method"] != "plain")
    fabric = payload["fabric_rows"]
    assert [(r["loader"], r["method"]) for r in fabric] == [
        (loader, method) for loader in ("sized", "unsized") for method in ("litgpt", "lookahead", "deferred")
    ]
    assert all(r["collectives_per_window"] == {"allreduce": 1} for r in fabric if r["method"] != "litgpt")


@pytest.mark.distributed
@pytest.mark.slow
def test_slow_loader_quick(tmp_path: Path) -> None:
    payload = run_script("slow_loader", tmp_path)
    for key in ("wait_ratio_lookahead", "wait_ratio_deferred"):
        assert isinstance(payload[key], float) and payload[key] > 0, (key, payload[key])
    held = {r["method"]: r["most_held"] for r in payload["rows"]}
    # K = 16 on a sized loader: lookahead holds exactly K batches ahead at most, deferred nothing, as plain DDP
    # (tests/test_strategy.py::test_batches_read_ahead pins the same for K in {1, 3} and streams)
    assert held == {"plain": 0, "lookahead": 16, "deferred": 0}, held


@pytest.mark.slow
def test_scale_model_quick(tmp_path: Path) -> None:
    payload = run_script("scale_model", tmp_path)
    for designs in payload["thresholds"].values():
        old, new = designs["old"], designs["new"]
        assert old is not None and (new is None or new > old), designs  # the new design crosses 1 % later, if ever
    # NCCL's model of the old design's 80-byte ring all_gather at P = 16,384 with 8 GPUs per node: ~17.7 ms
    assert 17e-3 < payload["collectives_seconds"]["16384"]["old_all_gather"] < 18.5e-3


@pytest.mark.slow
def test_quick_runs_never_write_the_recorded_results() -> None:
    before = {path: path.stat().st_mtime_ns for path in RESULTS.iterdir()}
    completed = run_bounded([sys.executable, str(BENCHMARKS / "scale_model.py"), "--quick"])
    assert completed.returncode == 0, completed.stderr[-3000:]
    wrote = completed.stdout.strip().splitlines()[-1]
    assert wrote.startswith("wrote ") and str(RESULTS) not in wrote, wrote
    assert {path: path.stat().st_mtime_ns for path in RESULTS.iterdir()} == before


@pytest.mark.distributed
@pytest.mark.slow
def test_gpu_step_quick() -> None:
    """The GPU benchmark's CPU smoke run (tiny model, 2 gloo processes, both regimes, 2 repetitions, the sync watch
    rehearsed), with its default paths: a temporary folder, written after each repetition, complete at the end."""
    before = {path: path.stat().st_mtime_ns for path in RESULTS.iterdir()}
    completed = run_bounded([sys.executable, str(BENCHMARKS / "gpu_step.py"), "--quick"])
    assert completed.returncode == 0, completed.stderr[-3000:]
    wrote = [line for line in completed.stdout.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 1 and str(RESULTS) not in wrote[0], wrote
    assert {path: path.stat().st_mtime_ns for path in RESULTS.iterdir()} == before
    partial = [line for line in completed.stdout.splitlines() if line.startswith("repetition 1 done")]
    _, json_path, _, markdown_path, *_ = wrote[0].split()
    assert len(partial) == 1 and partial[0].endswith(json_path), (partial, json_path)
    assert Path(markdown_path).read_text().count("|") > 10, "no markdown table written"
    payload: dict[str, Any] = json.loads(Path(json_path).read_text())
    assert_environment(payload, "gpu_step")
    assert payload["environment"]["gpu"]["available"] is False
    configuration = payload["environment"]["configuration"]
    assert configuration["quick"] is True and configuration["repeats_done"] == 2 and payload["complete"] is True
    methods, regimes = ("plain", "lookahead", "deferred"), ("host-bound", "device-bound")
    assert [(row["regime"], row["method"]) for row in payload["rows"]] == [(r, m) for r in regimes for m in methods]
    for row in payload["rows"]:
        assert row["repeats"] == 2 and len(row["ratios"]) == 2, row
        low, high = row["ratio_interval"]
        assert low <= row["ratio_median"] <= high, row
    for key in (f"ratio_{method}_{regime}" for method in methods[1:] for regime in regimes):
        assert isinstance(payload[key], float) and payload[key] > 0, (key, payload.get(key))
    counts = [fit["global_counts"] for fit in payload["fits"] if fit["method"] != "plain"]
    assert all(len(set(steps)) > 1 for steps in counts), "every step held as many target tokens: not ragged"
    # the rehearsed sync watch: one read of the package per window, after its last backward, and the count check's
    reads = {watched["method"]: watched["package"] for watched in payload["host_reads"]}
    assert reads["plain"]["per_window"] == 0 and reads["plain"]["count_checks"] == []
    for method in methods[1:]:
        assert reads[method]["per_window_by_place"] == {
            "after the window's last backward, before its optimizer step": 1.0
        }, reads[method]
        [check] = reads[method]["count_checks"]
        # three forwards without gradient per micro-batch of the first window: the whole and the two parts of its
        # labels (every micro-batch of this ragged data holds at least two valid labels)
        replays = 3 * configuration["accumulate_grad_batches"]
        assert (check["window"], check["steps"], check["replays"]) == (0, 0, replays) and check["syncs"] > 0, check


@pytest.mark.slow
@pytest.mark.skipif(cuda_devices() > 0, reason="the refusal only happens without CUDA")
def test_gpu_step_refuses_to_run_without_cuda() -> None:
    completed = run_bounded([sys.executable, str(BENCHMARKS / "gpu_step.py")])
    assert completed.returncode == 2, completed.stderr[-3000:]
    assert "no CUDA device" in completed.stderr and "--quick" in completed.stderr


