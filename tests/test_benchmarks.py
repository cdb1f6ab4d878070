"""Smoke tests: each benchmark script runs with its ``--quick`` settings, exits 0 and writes the expected JSON.

Real subprocesses (the scripts fork their own gloo workers); no timing is asserted, only fidelity, which is exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
EXACT = 1e-12


def run_script(name: str, tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / f"{name}.json"
    markdown = tmp_path / f"{name}.md"
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--json", str(out), "--markdown", str(markdown),
         *args],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, f"{name}.py exited {completed.returncode}:\n{completed.stderr[-3000:]}"
    assert markdown.read_text().count("|") > 10, "no markdown table written"
    payload: dict[str, object] = json.loads(out.read_text())
    environment = payload["environment"]
    assert isinstance(environment, dict)
    for key in ("date", "cpu", "cores", "torch", "lightning", "configuration"):
        assert key in environment, f"{name}.json lacks environment[{key!r}]"
    return payload


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
def test_model_parallel_quick(tmp_path: Path) -> None:
    payload = run_script("model_parallel", tmp_path)
    for key in ("ratio_lookahead", "ratio_deferred"):
        value = payload[key]
        assert isinstance(value, float) and value > 0, (key, value)
