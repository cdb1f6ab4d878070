"""The GPU lane: the CUDA and NCCL paths no CPU run reaches, each test skipped without CUDA (marker ``gpu``).

- Deferred mode under DDP on NCCL folds D/N into DDP's bucket all-reduce as ``PREMUL_SUM`` (gloo takes the in-place
  scale instead): every bucket all-reduce of its comm hook takes that branch, and the result is the float64
  reference's at 1e-12 (the harness model is float64, which NCCL reduces natively).
- Lookahead under DDP on NCCL, both modes under FSDP2 (``TokenMeanModelParallelStrategy``, one data-parallel rank per
  GPU) on NCCL: exact against the same reference; plain ``DDPStrategy`` and ``ModelParallelStrategy`` miss it.
- Fingerprints: ``global_norm`` of CUDA tensors, the fused ``torch._foreach_norm`` path, is within 1e-6 of the float64
  norm for float32 and bfloat16.
- No synchronizing CUDA operation of the package between a window's first forward and its last backward, in either
  mode, under DDP and FSDP2 (``torch.cuda.set_sync_debug_mode``, ``tests/_sync.py``), with a control that reads on
  the host and is seen; with the count check on (the default), every window holds its K micro-batches.
- The count check's host reads: once per fit, in the strategy's ``optimizer_step`` after the first window's last
  backward and before the first optimizer step (its replays of ``training_step`` without gradient, three per
  micro-batch of the first window under DDP, seen reading on the host there), never inside a window.

The same fits' bookkeeping is rehearsed on the CPU (``--cpu``: gloo, the watch warning where a CUDA tensor would
synchronize), in the ``slow`` lane, so the assertions here run before they ever meet a GPU.

The fits run under Lightning's subprocess launcher (``tests/scripts/gpu_token_mean.py``, one process per GPU: at most
2 for DDP, all of them for FSDP2); on one GPU, a one-process job still runs NCCL, DDP's reducer and the comm hook.
Each fit runs once and serves every test that reads it. CUDA is never initialized in the pytest process itself
(``tests/_gpu.py``), so the CPU tests can still fork their workers in the same session.

    pytest -m gpu tests/test_gpu.py       # on a machine with CUDA (about 2 min on one GPU)
    bash benchmarks/gpu_check.sh          # the lane and benchmarks/gpu_step.py in one command (make gpu)
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _gpu import NORM_CASES, cuda_devices, cuda_norm_cases, in_spawned_process, requires_cuda
from _harness import EXACT, MODES, constant, reference, relative_error
from _jobs import run_bounded
from torch import Tensor

SCRIPT = Path(__file__).parent / "scripts" / "gpu_token_mean.py"
sys.path.insert(0, str(SCRIPT.parent))
from gpu_token_mean import ACCUMULATE, BATCHES, METHODS, STEADY, data  # noqa: E402 (the script's directory, just added)

LAUNCH_TIMEOUT = 240  # seconds per fit: process start, CUDA and NCCL initialization dominate a 12-batch fit
WINDOWS = BATCHES // ACCUMULATE


def count_check_replays(strategy: str, rank: int, devices: int) -> int:
    """The count check's forwards without gradient on ``rank``: under DDP the micro-batch and each half of its
    labels, for every micro-batch of the first window with two valid labels; under FSDP2 every rank runs as many,
    the most any micro-batch can take (``_count_check.forwards_per_sample``)."""
    from token_mean._count_check import forwards_per_sample

    if strategy == "fsdp2":
        return ACCUMULATE * forwards_per_sample([(None, None, "mean")])
    window = data(devices)[rank][:ACCUMULATE]
    return 3 * sum(int((batch["labels"] != -100).sum()) >= 2 for batch in window)


def devices_for(strategy: str) -> int:
    """DDP: 2 processes where there are 2 GPUs, else 1; FSDP2: one data-parallel rank per GPU."""
    return min(cuda_devices(), 2) if strategy == "ddp" else cuda_devices()


@dataclass(frozen=True)
class Run:
    devices: int
    params: dict[str, Tensor]
    windows: list[dict[str, Any]]
    ranks: list[dict[str, Any]]  # every rank's comm hook counts, window lengths and syncs (gpu_token_mean.py)


class Runs:
    """Each fit once, launched when a test first asks for it; a failed launch fails every test that reads it.
    ``cpu``: the rehearsal (``gpu_token_mean.py --cpu``), one CPU process per fit."""

    def __init__(self, root: Path, cpu: bool = False) -> None:
        self.root = root
        self.cpu = cpu
        self._runs: dict[tuple[str, str, bool], Run | str] = {}

    def launch_together(self, keys: list[tuple[str, str, bool]], processes: int) -> None:
        """Launch the fits of ``keys`` at once, ``processes`` at a time (the CPU rehearsal's are a few seconds each,
        mostly imports)."""
        with concurrent.futures.ThreadPoolExecutor(processes) as pool:
            for key, run in zip(keys, pool.map(lambda key: self._launch(*key), keys), strict=True):
                self._runs[key] = run

    def get(self, strategy: str, method: str, reads: bool = False) -> Run:
        key = (strategy, method, reads)
        if key not in self._runs:
            self._runs[key] = self._launch(*key)
        run = self._runs[key]
        if isinstance(run, str):
            pytest.fail(run, pytrace=False)
        return run

    def _launch(self, strategy: str, method: str, reads: bool) -> Run | str:
        devices = 1 if self.cpu else devices_for(strategy)
        out = self.root / f"{strategy}-{method}{'-reads' if reads else ''}"
        command = [sys.executable, str(SCRIPT), str(out), "--strategy", strategy, "--method", method,
                   "--devices", str(devices), *(["--reads"] if reads else []), *(["--cpu"] if self.cpu else [])]
        try:
            completed = run_bounded(command, timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired as error:
            return f"{' '.join(command[1:])} ran past {LAUNCH_TIMEOUT} s:\n{str(error.stderr or '')[-4000:]}"
        if completed.returncode != 0:
            return f"{' '.join(command[1:])} exited {completed.returncode}:\n{completed.stderr[-6000:]}"
        params = torch.load(out / "params.pt", weights_only=True)
        return Run(
            devices,
            {k.removeprefix("net."): v for k, v in params.items()},
            json.loads((out / "windows.json").read_text()),
            [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(devices)],
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("gpu-runs"))


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("gpu-rehearsal-runs"), cpu=True)
    runs.launch_together([("ddp", method, False) for method in METHODS] + [("ddp", "plain", True)], processes=2)
    return runs


def assert_matches_reference(run: Run, method: str, what: str) -> None:
    expected, counts = reference(data(run.devices), constant(ACCUMULATE))
    error = relative_error(run.params, expected)
    if method == "plain":
        assert error > 1e-6, f"plain {what} matched the token mean on CUDA: the test could not fail"
        return
    assert error < EXACT, f"{method} under {what} on {run.devices} GPU(s): relative parameter error {error:.3e}"
    assert [w["global_count"] for w in run.windows] == counts


# ---------------------------------------------------------------------------------------------------------------
# DDP on NCCL
# ---------------------------------------------------------------------------------------------------------------


@requires_cuda()
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_ddp_on_nccl_matches_the_reference(runs: Runs, method: str) -> None:
    assert_matches_reference(runs.get("ddp", method), method, "DDP")


@requires_cuda()
@pytest.mark.timeout(300)
def test_deferred_scales_inside_nccls_all_reduce(runs: Runs) -> None:
    """Every bucket all-reduce of a window's last backward goes through the comm hook and takes ``PREMUL_SUM``."""
    run = runs.get("ddp", "deferred")
    windows = len(run.windows)
    assert windows == 4
    for rank in run.ranks:
        hooks, premul = rank["hook_calls"], rank["premul_sum_calls"]
        # DDP calls the hook once per bucket in each window's last backward (the others run under `no_sync`)
        assert hooks >= windows and hooks % windows == 0, f"rank {rank['rank']}: {hooks} hook calls, {windows} windows"
        assert premul == hooks, f"rank {rank['rank']}: {premul} of {hooks} bucket all-reduces took PREMUL_SUM"
    lookahead = runs.get("ddp", "lookahead")
    assert all(rank["hook_calls"] == 0 for rank in lookahead.ranks), "lookahead left DDP's own all-reduce alone"


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 on NCCL
# ---------------------------------------------------------------------------------------------------------------


@requires_cuda()
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_fsdp2_on_nccl_matches_the_reference(runs: Runs, method: str) -> None:
    """``AfterReduction``'s shard multiply (deferred) and the scaled losses (lookahead) after FSDP2's NCCL
    reduce-scatter, one data-parallel rank per GPU."""
    assert_matches_reference(runs.get("fsdp2", method), method, "ModelParallelStrategy (FSDP2)")


# ---------------------------------------------------------------------------------------------------------------
# no host sync inside a window; the count check's, once per fit
# ---------------------------------------------------------------------------------------------------------------


def describe(syncs: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{s['stage']}, window {s['window']} ({s['phase'] or 'steps begun ' + str(s['steps'])}): {s['where']}\n"
        f"{s['stack']}"
        for s in syncs[:6]
    )


def step_syncs(rank: dict[str, Any], window: int) -> list[dict[str, Any]]:
    return [s for s in rank["syncs"] if s["stage"] == "inside" and s["window"] == window and s["phase"] == "step"]


def assert_no_sync_inside_a_window(run: Run, plain: Run, what: str) -> None:
    """Every window holds its K micro-batches (the count check's replays are not among them); none of the package's
    syncs falls inside a window; in the steady windows the strategy's hooks sync no more than plain's."""
    for mine, theirs in zip(run.ranks, plain.ranks, strict=True):
        where = f"{what}, rank {mine['rank']}"
        assert mine["window_lengths"] == [ACCUMULATE] * WINDOWS, f"{where}: micro-batches per window"
        ours = [s for s in mine["syncs"] if s["stage"] == "inside" and s["origin"] == "token_mean"]
        assert not ours, f"{where}: {len(ours)} syncs issued by token_mean inside windows:\n{describe(ours)}"
        for window in range(STEADY, WINDOWS):
            extra = step_syncs(mine, window)
            assert len(extra) <= len(step_syncs(theirs, window)), f"{where}:\n{describe(extra)}"


def assert_the_count_check_reads_once_at_the_first_windows_end(run: Run, what: str, strategy: str = "ddp") -> None:
    """One count check per fit, run by the strategy's ``optimizer_step`` after the first window's last backward (the
    closure's) and before the first optimizer step: its replays without gradient and its host reads (the labels'
    cuts, the replayed losses) all fall there, none inside a window."""
    for rank in run.ranks:
        where = f"{what}, rank {rank['rank']}"
        replays_expected = count_check_replays(strategy, rank["rank"], run.devices)
        checks = rank["count_checks"]
        assert len(checks) == 1, f"{where}: the count check ran {len(checks)} times in one fit: {checks}"
        check = checks[0]
        assert (check["window"], check["steps"]) == (0, 0), f"{where}: not after window 0 before step 0: {check}"
        assert check["replays"] == replays_expected, f"{where}: {check['replays']} replays in the count check"
        replays = [replay["in_count_check"] for replay in rank["replays"]]
        assert replays == [True] * replays_expected, f"{where}: replays outside the count check: {rank['replays']}"
        seen = [s for s in rank["syncs"] if s["stage"] == "count_check"]
        assert check["syncs"] == len(seen), f"{where}: {check['syncs']} syncs counted, {len(seen)} filed"
        assert all((s["window"], s["steps"]) == (0, 0) for s in seen), describe(seen)
        # its own reads (the labels' split, the replayed losses: token_mean/_count_check.py) are seen there
        assert any(s["origin"] == "token_mean" for s in seen), f"{where}: no host read of the count check seen"
        later = [s for s in rank["syncs"] if s["stage"] == "inside" and "_count_check.py" in s["stack"]]
        assert not later, f"{where}: the count check's code read inside a window:\n{describe(later)}"


def assert_the_watch_sees_host_reads(run: Run) -> None:
    """In every micro-batch of every window: the loss's read in ``training_step`` and its gradient's in a backward
    hook, attributed to their caller."""
    for rank in run.ranks:
        for window, length in enumerate(rank["window_lengths"]):
            seen = step_syncs(rank, window)
            assert len(seen) >= 2 * length, f"rank {rank['rank']}, window {window}: {len(seen)} syncs seen"
            assert any(s["where"].startswith("gpu_token_mean.py") for s in seen), describe(seen)


@requires_cuda()
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("mode", MODES)
def test_no_sync_inside_a_window(runs: Runs, strategy: str, mode: str) -> None:
    """No synchronizing CUDA operation issued by the package between a window's first forward and its last
    backward, in any window, with the count check on; and in the steady windows, none in the strategy's
    ``training_step`` and ``backward`` beyond what the plain strategy's own run has there (none expected:
    Lightning's own per-batch read, before each batch, is between them)."""
    assert_no_sync_inside_a_window(runs.get(strategy, mode), runs.get(strategy, "plain"), f"{mode} under {strategy}")


@requires_cuda()
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("mode", MODES)
def test_the_count_check_reads_once_after_the_first_window(runs: Runs, strategy: str, mode: str) -> None:
    """The count check on a GPU: its host reads happen once per fit, in ``TokenMeanStrategy.optimizer_step`` after
    the first window's last backward and before the first optimizer step, and never inside a later window."""
    assert_the_count_check_reads_once_at_the_first_windows_end(
        runs.get(strategy, mode), f"{mode} under {strategy}", strategy
    )


@requires_cuda()
@pytest.mark.timeout(300)
def test_sync_watch_sees_host_reads(runs: Runs) -> None:
    """The control: a ``training_step`` that reads its loss and a backward hook that reads its gradient are seen in
    every micro-batch, attributed to their caller, so the zeros above come from a watch that sees."""
    assert_the_watch_sees_host_reads(runs.get("ddp", "plain", reads=True))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_lane_rehearsed_on_the_cpu(cpu_runs: Runs, mode: str) -> None:
    """The lane's bookkeeping on the CPU, where the watch warns at every read a CUDA tensor would sync at: windows
    of K micro-batches with the count check on, its reads once after the first window, none inside one."""
    run = cpu_runs.get("ddp", mode)
    assert_no_sync_inside_a_window(run, cpu_runs.get("ddp", "plain"), f"{mode} under DDP on the CPU")
    assert_the_count_check_reads_once_at_the_first_windows_end(run, f"{mode} under DDP on the CPU")
    assert all(check == [] for check in (r["count_checks"] for r in cpu_runs.get("ddp", "plain").ranks))


@pytest.mark.slow
def test_the_watchs_control_rehearsed_on_the_cpu(cpu_runs: Runs) -> None:
    assert_the_watch_sees_host_reads(cpu_runs.get("ddp", "plain", reads=True))


# ---------------------------------------------------------------------------------------------------------------
# fingerprints on CUDA: the fused _foreach_norm
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_norms() -> dict[str, dict[str, Any]]:
    return in_spawned_process(cuda_norm_cases)


@requires_cuda()
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_global_norm_on_cuda_is_close_to_float64(cuda_norms: dict[str, dict[str, Any]], case: str) -> None:
    result = cuda_norms[case]
    assert "error" not in result, result.get("error")
    assert (result["dtype"], result["device"]) == ("torch.float64", "cuda")
    # float32 accumulation, whatever the input dtype: about float32's rounding, not bfloat16's three digits
    assert result["norm"] == pytest.approx(result["reference"], rel=1e-6)
    assert result["read"] == {"_foreach_norm": result["elements"], "vector_norm": 0}, "not the fused path alone"
