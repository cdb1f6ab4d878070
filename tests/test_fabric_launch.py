"""``TokenMeanAccumulator`` under every Fabric launcher: both modes against the float64 reference (1e-12).

Each launcher trains the case of ``tests/scripts/fabric_token_mean.py`` (the LitGPT-shaped loop of
``tests/_fabric.py``: 7 ragged batches per rank, K = 3, 2 passes, one micro-batch without a target) and must end on
the parameters of the unpartitioned plain-torch reference, with every window's N the reference's. Every process that
trained must have exited with its process group destroyed before the interpreter finalized: the accumulator
registers the package's exit handler (``token_mean/_exit.py``) when the world is distributed, and the script never
destroys the group itself. The control: LitGPT's own loop misses this case, so every launcher test can fail.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _fabric import fabric_for, launched, plain_loop, reference
from _harness import EXACT, MODES, relative_error
from _jobs import TORCHRUN, assert_process_group_destroyed_before_exit, run_job
from scripts.fabric_token_mean import ACCUMULATE, EPOCHS, data

SCRIPT = Path(__file__).parent / "scripts" / "fabric_token_mean.py"


def script(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out), *args]


def assert_matches_reference(out: Path, environment: str, modes: tuple[str, ...] = MODES) -> None:
    expected, counts = reference(data(), ACCUMULATE, EPOCHS)
    for mode in modes:
        error = relative_error(torch.load(out / mode / "params.pt", weights_only=True), expected)
        assert error < EXACT, f"{mode}: relative parameter error {error:.3e}"
        windows = json.loads((out / mode / "windows.json").read_text())
        assert [window["global_count"] for window in windows] == counts, mode
        run = json.loads((out / mode / "run.json").read_text())
        assert run == {"environment": environment, "world_size": 2}, mode


@pytest.mark.distributed
@pytest.mark.slow
def test_subprocess_launcher_both_modes(tmp_path: Path) -> None:
    """Fabric's default launcher re-runs the script per rank; lookahead then trains in the same two processes, on
    the process group deferred's `fabric.launch()` set up."""
    run_job([script(tmp_path, "--mode", "deferred", "lookahead")], tmp_path / "logs")
    assert_matches_reference(tmp_path, "LightningEnvironment")
    assert_process_group_destroyed_before_exit(tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_spawn_launcher(tmp_path: Path) -> None:
    """Spawned workers import the script as `__mp_main__` and finalize the interpreter on exit: each reports. One
    mode (the default; each mode spawns its workers anew, ~9 s here): the other launchers run both."""
    run_job([script(tmp_path, "--mode", "lookahead", "--start-method", "spawn")], tmp_path / "logs")
    assert_matches_reference(tmp_path, "LightningEnvironment", ("lookahead",))
    assert_process_group_destroyed_before_exit(tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_one_node_both_modes(tmp_path: Path) -> None:
    # --standalone: torchrun hosts its rendezvous store on a port it binds itself (localhost:0) and keeps
    command = [
        str(TORCHRUN), "--standalone", "--nnodes=1", "--nproc_per_node=2", *script(tmp_path, "--mode", *MODES)[1:]
    ]
    run_job([command], tmp_path / "logs")
    assert_matches_reference(tmp_path, "TorchElasticEnvironment")
    assert_process_group_destroyed_before_exit(tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_fork_launcher_both_modes(tmp_path: Path) -> None:
    """The script passes under fork too; forked workers leave with `os._exit` (no exit handler runs, no report)."""
    run_job([script(tmp_path, "--mode", *MODES, "--start-method", "fork")], tmp_path / "logs")
    assert_matches_reference(tmp_path, "LightningEnvironment")
    assert not list(tmp_path.glob("exit-rank*.json"))


@pytest.mark.distributed
def test_litgpt_loop_misses_the_launcher_case() -> None:
    """The control: LitGPT's `fabric.backward(loss / K)` lands elsewhere on this case (forked, in this process)."""
    params = launched(fabric_for("ddp"), plain_loop, data(), ACCUMULATE, EPOCHS)
    expected, _ = reference(data(), ACCUMULATE, EPOCHS)
    assert relative_error(params, expected) > 1e-6
