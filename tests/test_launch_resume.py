"""Every launcher, checkpoint and resume, and a rank that leaves: both modes against the float64 reference (1e-12).

Each launcher (Lightning's subprocess launcher, spawn, fork, torchrun on one node and on two) trains the case of
``tests/scripts/launch_token_mean.py`` and must end on the parameters of the unpartitioned plain-torch reference; a
resumed run must end where the uninterrupted one does. The tests can fail: plain DDP misses the launchers' case,
resuming mid-epoch without a stateful loader misses the reference, DDP's `timeout` is read back from every rank's
process group (torch's default is 30 minutes), and a stalled rank would hang for those 30 minutes without it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _harness import (
    EXACT,
    FORK,
    MODES,
    Batch,
    TokenModule,
    constant,
    empty_like,
    fit,
    ragged_batches,
    reference,
    relative_error,
)
from _jobs import TORCHRUN, assert_process_group_destroyed_before_exit, run_job
from _ranks import raises_everywhere
from _resume_helpers import (
    CHECKPOINT_EVERY,
    BatchLog,
    ResumableModule,
    SaveAtBatch,
    checkpoint_at,
    fit_checkpointed,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from scripts.launch_token_mean import ACCUMULATE, EPOCHS, DestroyProcessGroup, data
from torch import Tensor

from token_mean import TokenMeanDDPStrategy

SCRIPT = Path(__file__).parent / "scripts" / "launch_token_mean.py"


def script(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out), *args]


def load_params(path: Path) -> dict[str, Tensor]:
    params = torch.load(path, weights_only=True)
    return {k.removeprefix("net."): v for k, v in params.items()}


def assert_matches_reference(out: Path, modes: tuple[str, ...] = MODES) -> None:
    expected, _ = reference(data(), constant(ACCUMULATE), epochs=EPOCHS)
    for mode in modes:
        error = relative_error(load_params(out / mode / "params.pt"), expected)
        assert error < EXACT, f"{mode}: relative parameter error {error:.3e}"


# ---------------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_subprocess_launcher_both_modes(tmp_path: Path) -> None:
    """Lightning's default launcher re-runs the script per rank; deferred goes first, so it gets the real launch.

    Lookahead then trains in the same two processes, on the process group the first fit set up, by its registered
    name (`strategy="ddp_token_mean"`), as users write it.
    """
    run_job([script(tmp_path, "--mode", "deferred", "lookahead", "--by-name")], tmp_path / "logs")
    assert_matches_reference(tmp_path)
    assert_process_group_destroyed_before_exit(tmp_path)
    run = json.loads((tmp_path / "deferred" / "run.json").read_text())
    strategy = "TokenMeanDDPStrategy"
    assert run == {"environment": "LightningEnvironment", "world_size": 2, "num_nodes": 1, "strategy": strategy}
    assert json.loads((tmp_path / "lookahead" / "run.json").read_text())["strategy"] == strategy  # by name


@pytest.mark.distributed
@pytest.mark.slow
def test_a_denominator_error_prints_one_self_contained_line_per_rank(tmp_path: Path) -> None:
    """Rank 1's loss is NaN under the subprocess launcher: each rank's traceback ends in the same error, whose first
    line holds the cause, the rank and the window, printed once per rank (torch's ``[rankN]:`` prefix), not once per
    frame or per chained exception."""
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_job([script(tmp_path, "--mode", "lookahead", "--rank1", "nan")], tmp_path / "logs")
    output = failed.value.output
    first = ("token_mean.errors.DenominatorError: token_mean: rank 1: the loss of a micro-batch that the count says"
             " holds valid items is NaN or infinite (or count × loss overflows float64), in the accumulation window"
             " of optimizer step 0 (epoch 0, batches 0..2).")
    lines = [line.split("]: ", 1)[-1] for line in output.splitlines() if "DenominatorError" in line]
    assert sorted(lines) == [first, first], output[-4000:]
    assert sum(f"[rank{rank}]: {first}" in output for rank in (0, 1)) == 2, output[-4000:]
    assert "During handling of the above exception" not in output and "direct cause" not in output


@pytest.mark.distributed
@pytest.mark.slow
def test_plain_ddp_with_the_monitor_frees_its_process_group_before_exit(tmp_path: Path) -> None:
    """The monitor measures on the default group under plain `DDPStrategy`, which never destroys it: the monitor
    registers the package's exit handler, so those processes exit without a live gloo group too."""
    run_job([script(tmp_path, "--mode", "plain")], tmp_path / "logs")
    assert_process_group_destroyed_before_exit(tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_script_that_destroys_its_process_group_still_frees_it_before_exit(tmp_path: Path) -> None:
    """Torch asks scripts to destroy the group when done; that only unregisters it, and Lightning's dropped DDP
    wrappers still hold it (with its gloo threads) in reference cycles. The package's exit handler must free it then
    too: before it did, this failed every run, and a spawned worker that destroyed its group aborted now and then
    (CI caught `test_spawn_launcher` so)."""
    run_job([script(tmp_path, "--mode", "deferred", "--destroy")], tmp_path / "logs")
    assert_matches_reference(tmp_path, ("deferred",))
    assert_process_group_destroyed_before_exit(tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_spawn_launcher(tmp_path: Path) -> None:
    """Spawned workers unpickle the Trainer, the module and its data: all of it must be importable from `_harness`.
    One mode (the default): the strategy pickles the same in both, and each launcher's modes are run elsewhere."""
    strategy = TokenMeanDDPStrategy(start_method="spawn", process_group_backend="gloo")
    params, _ = fit(TokenModule(data()), strategy, tmp_path, accumulate_grad_batches=ACCUMULATE, max_epochs=EPOCHS,
                    callbacks=[DestroyProcessGroup()])
    expected, _ = reference(data(), constant(ACCUMULATE), epochs=EPOCHS)
    assert relative_error(params, expected) < EXACT


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_fork_launcher(tmp_path: Path, mode: str) -> None:
    strategy = TokenMeanDDPStrategy(mode=mode, **FORK)  # type: ignore[arg-type]
    params, _ = fit(TokenModule(data()), strategy, tmp_path, accumulate_grad_batches=ACCUMULATE, max_epochs=EPOCHS)
    expected, _ = reference(data(), constant(ACCUMULATE), epochs=EPOCHS)
    assert relative_error(params, expected) < EXACT


@pytest.mark.distributed
def test_plain_ddp_misses_the_launcher_case(tmp_path: Path) -> None:
    """The control: on this case plain DDP's mean of means lands elsewhere, so every launcher test can fail."""
    strategy = DDPStrategy(**FORK)
    params, _ = fit(TokenModule(data()), strategy, tmp_path, accumulate_grad_batches=ACCUMULATE, max_epochs=EPOCHS)
    expected, _ = reference(data(), constant(ACCUMULATE), epochs=EPOCHS)
    assert relative_error(params, expected) > 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_one_node(tmp_path: Path) -> None:
    # --standalone: torchrun hosts its rendezvous store on a port it binds itself (localhost:0) and keeps
    command = [
        str(TORCHRUN), "--standalone", "--nnodes=1", "--nproc_per_node=2", *script(tmp_path, "--mode", *MODES)[1:]
    ]
    run_job([command], tmp_path / "logs")
    assert_matches_reference(tmp_path)
    assert_process_group_destroyed_before_exit(tmp_path)
    for mode in MODES:
        run = json.loads((tmp_path / mode / "run.json").read_text())
        assert run == {"environment": "TorchElasticEnvironment", "world_size": 2, "num_nodes": 1,
                       "strategy": "TokenMeanDDPStrategy"}


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_two_nodes_on_loopback(tmp_path: Path) -> None:
    """How a cluster job starts: one torchrun per node, here two nodes of one process each on 127.0.0.1.

    The nodes meet at a rendezvous store that this test hosts on a port it binds and holds (port 0: no free-port
    guess that another process could take first); the agent of rendezvous rank 0 then hosts the workers' store the
    same way.
    """
    rendezvous = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    commands = [
        [
            str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{rendezvous.port}", "--rdzv-conf=is_host=false", f"--rdzv-id={tmp_path.name}",
            "--local-addr=127.0.0.1", *script(tmp_path, "--mode", *MODES, "--nodes", "2")[1:],
        ]
        for _ in (0, 1)
    ]
    try:
        run_job(commands, tmp_path / "logs")
    finally:
        del rendezvous
    assert_matches_reference(tmp_path)
    assert_process_group_destroyed_before_exit(tmp_path)
    for mode in MODES:
        run = json.loads((tmp_path / mode / "run.json").read_text())
        assert run == {"environment": "TorchElasticEnvironment", "world_size": 2, "num_nodes": 2,
                       "strategy": "TokenMeanDDPStrategy"}


# ---------------------------------------------------------------------------------------------------------------
# checkpoint and resume: 7 batches per rank, K = 2, 2 epochs: windows [0, 1] [2, 3] [4, 5] [6] per epoch, a
# checkpoint every 2 steps: step 2 mid-epoch 0, step 4 at the end of epoch 0, step 6 mid-epoch 1
# ---------------------------------------------------------------------------------------------------------------

RESUME_ACCUMULATE, RESUME_EPOCHS = 2, 2
MID_EPOCH_0, END_OF_EPOCH_0, MID_EPOCH_1 = CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY, 3 * CHECKPOINT_EVERY


def resume_data() -> list[list[Batch]]:
    return ragged_batches(2, 7, seed=21)


Uninterrupted = Callable[[str, bool], Path]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Uninterrupted:
    """The output folder of one uninterrupted, checkpointing run per (mode, stateful loader), made on first use."""
    runs: dict[tuple[str, bool], Path] = {}

    def run(mode: str, stateful: bool) -> Path:
        if (mode, stateful) not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{mode}-{'stateful' if stateful else 'plain'}")
            fit_checkpointed(ResumableModule(resume_data(), stateful), mode, out)
            runs[mode, stateful] = out
        return runs[mode, stateful]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("stateful", "step"),
    [(True, MID_EPOCH_0), (True, END_OF_EPOCH_0), (True, MID_EPOCH_1), (False, END_OF_EPOCH_0)],
    ids=["stateful-mid-epoch-0", "stateful-epoch-end", "stateful-mid-epoch-1", "plain-epoch-end"],
)
def test_resume_matches_uninterrupted(
    tmp_path: Path, uninterrupted: Uninterrupted, mode: str, stateful: bool, step: int
) -> None:
    """Parameters, momentum buffers, the loop position and the loader's position come back from the checkpoint."""
    expected, counts = reference(resume_data(), constant(RESUME_ACCUMULATE), epochs=RESUME_EPOCHS)
    full_out = uninterrupted(mode, stateful)
    full = load_params(full_out / "params.pt")
    assert relative_error(full, expected) < EXACT
    resumed = fit_checkpointed(
        ResumableModule(resume_data(), stateful), mode, tmp_path, ckpt_path=checkpoint_at(full_out, step)
    )
    assert relative_error(resumed, expected) < EXACT
    assert relative_error(resumed, full) < EXACT
    windows = json.loads((tmp_path / "windows.json").read_text())
    assert [w["global_count"] for w in windows] == counts[step:], "the resumed run trained on other batches"


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_mid_epoch_resume_without_stateful_loader_misses(
    tmp_path: Path, uninterrupted: Uninterrupted, mode: str
) -> None:
    """The control: a plain loader restarts the epoch from its first batch (Lightning warns), so the resume test can
    fail."""
    expected, _ = reference(resume_data(), constant(RESUME_ACCUMULATE), epochs=RESUME_EPOCHS)
    checkpoint = checkpoint_at(uninterrupted(mode, False), MID_EPOCH_0)
    resumed = fit_checkpointed(ResumableModule(resume_data(), False), mode, tmp_path, ckpt_path=checkpoint)
    assert relative_error(resumed, expected) > 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_resume_restores_strategy_state(tmp_path: Path, mode: str) -> None:
    """A resumed run should be the uninterrupted run: same skipped-step count, bitwise the same parameters.

    Window [2, 3] holds no valid item on any rank, so steps 2 and 6 are skipped; resumed at step 6, the run must
    count both. In deferred mode the provisional denominator D travels with the checkpoint too: sized afresh, it would
    change the parameters by a rounding error (within 1e-12, but not bitwise).
    """
    empty = [(rank, index) for rank in (0, 1) for index in (2, 3)]
    data = resume_data()
    for rank, index in empty:
        data[rank][index] = empty_like(data[rank][index])
    expected, counts = reference(data, constant(RESUME_ACCUMULATE), epochs=RESUME_EPOCHS)
    assert counts.count(0.0) == 2
    full = fit_checkpointed(ResumableModule(data, True), mode, tmp_path / "full")
    checkpoint = checkpoint_at(tmp_path / "full", MID_EPOCH_1)
    resumed = fit_checkpointed(ResumableModule(data, True), mode, tmp_path / "resumed", ckpt_path=checkpoint)
    assert relative_error(resumed, expected) < EXACT  # the objective itself survives the resume
    skipped = [int((tmp_path / run / "skipped_steps.txt").read_text()) for run in ("full", "resumed")]
    assert skipped == [2, 2], f"skipped_steps (uninterrupted, resumed) = {skipped}"
    assert all(torch.equal(resumed[k], full[k]) for k in full), "the resumed parameters are not bitwise the same"


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_saved_inside_a_window_warns_and_its_resume_is_refused_on_every_rank(
    tmp_path: Path, mode: str
) -> None:
    """A checkpoint after batch 3, the first of window [3, 4, 5] (K = 3), as a time- or validation-triggered save or
    a pre-emption makes: no checkpoint holds that window's partial gradient, so the resume cannot be the uninterrupted
    run. Saving it warns (naming the settings that keep saves on window boundaries) and leaves the run exact; resuming
    from it raises on every rank before any batch trains."""
    data = resume_data()
    expected, _ = reference(data, constant(3), epochs=1)
    checkpoint = tmp_path / "mid-window.ckpt"
    full = fit_checkpointed(ResumableModule(data, True), mode, tmp_path / "full", accumulate=3, epochs=1,
                            callbacks=[SaveAtBatch(checkpoint, 3)])
    assert relative_error(full, expected) < EXACT  # saving inside the window changes nothing
    (warning,) = json.loads(checkpoint.with_suffix(".warnings.json").read_text())
    inside = "the accumulation window of optimizer step 1 (epoch 0, batches 3..5), after batch 3"
    assert warning.startswith(f"token_mean: saving a checkpoint inside {inside}"), warning
    assert "`val_check_interval` that is a multiple of `accumulate_grad_batches` (here 3)" in warning, warning
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit_checkpointed(
        ResumableModule(data, True), mode, tmp_path / "resumed", ckpt_path=checkpoint, accumulate=3, epochs=1,
        callbacks=[BatchLog(tmp_path / "seen.json")],
    ))
    for message in errors:
        assert message.startswith(f"ValueError: token_mean: the checkpoint being resumed was saved inside {inside}"), (
            message)
    assert not (tmp_path / "seen.json").exists(), "a batch trained before the refusal"


@pytest.mark.distributed
def test_plain_ddp_resumes_a_checkpoint_saved_inside_a_window_silently_and_misses(tmp_path: Path) -> None:
    """The control: plain DDP resumes from the same checkpoint without a word, and ends elsewhere than its own
    uninterrupted run (batch 3's gradient is lost), which is what the refusal prevents."""
    data = resume_data()
    checkpoint = tmp_path / "mid-window.ckpt"
    full = fit_checkpointed(ResumableModule(data, True), "plain", tmp_path / "full", accumulate=3, epochs=1,
                            callbacks=[SaveAtBatch(checkpoint, 3)])
    assert json.loads(checkpoint.with_suffix(".warnings.json").read_text()) == []
    resumed = fit_checkpointed(ResumableModule(data, True), "plain", tmp_path / "resumed", ckpt_path=checkpoint,
                               accumulate=3, epochs=1)
    assert relative_error(resumed, full) > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_resume_after_a_rank_ran_out(tmp_path: Path, mode: str) -> None:
    """Uneven per-rank shards (7 and 5 batches, K = 2), checkpointed after step 3 (window [4, 5]), when rank 1 is
    already repeating a batch at weight zero: the resumed window [6] must again hold rank 0's batch 6 alone.

    Lightning alone would load rank 0's position 6 on every rank, past rank 1's end: this loader would then start
    rank 1's shard over and train its batch 0 at full weight. The strategy saves each rank's position and whether it
    had run out, so rank 1 goes on repeating a batch at weight zero.
    """
    data = ragged_batches(2, 7, seed=21, keep=(0.9, 0.6))
    data[1] = data[1][:5]
    expected, counts = reference(data, constant(2))
    full = fit_checkpointed(ResumableModule(data, True), mode, tmp_path / "full", epochs=1, every=3)
    assert relative_error(full, expected) < EXACT
    checkpoint = checkpoint_at(tmp_path / "full", 3)
    resumed = fit_checkpointed(ResumableModule(data, True), mode, tmp_path / "resumed", ckpt_path=checkpoint, epochs=1)
    windows = json.loads((tmp_path / "resumed" / "windows.json").read_text())
    assert [w["global_count"] for w in windows] == counts[3:], "the resumed run trained on other batches"
    assert relative_error(resumed, expected) < EXACT


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_resume_when_read_ahead_reached_a_rank_end(tmp_path: Path, mode: str) -> None:
    """Shards of 7 and 5 batches, K = 3, checkpointed after step 1: lookahead has read rank 1's batches 3 and 4 and
    hit its end, but Lightning has not trained them. The resumed rank 1 must train them at full weight, not restore
    itself as exhausted and train fillers instead."""
    data = ragged_batches(2, 7, seed=31)
    data[1] = data[1][:5]
    expected, counts = reference(data, constant(3))
    fit_checkpointed(ResumableModule(data, True), mode, tmp_path / "full", accumulate=3, epochs=1, every=1)
    checkpoint = checkpoint_at(tmp_path / "full", 1)
    resumed = fit_checkpointed(
        ResumableModule(data, True), mode, tmp_path / "resumed", ckpt_path=checkpoint, accumulate=3, epochs=1
    )
    windows = json.loads((tmp_path / "resumed" / "windows.json").read_text())
    assert [w["global_count"] for w in windows] == counts[1:], "the resumed run trained on other batches"
    assert relative_error(resumed, expected) < EXACT


# ---------------------------------------------------------------------------------------------------------------
# a rank that leaves. What the package guarantees: DDP's `timeout` reaches the default process group, on which every
# collective of the strategy runs (the window record, the loader-length agreement, DDP's gradient all-reduce and the
# deferred mode's hook in it), so a rank left waiting for a dead or silent peer fails within that timeout instead of
# torch's 30 minute default. How gloo then fails (a reset connection, a closed pair) is gloo's, and not tested here.
# ---------------------------------------------------------------------------------------------------------------

COLLECTIVE_TIMEOUT = timedelta(seconds=123)  # anything but torch's default of 30 minutes
STALL_TIMEOUT = 5.0  # seconds: short enough for the suite, long enough for forked workers to meet at the rendezvous


class ProcessGroupTimeout(Callback):
    """Every rank writes the timeout of the default process group, on which the strategy's collectives run."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        backend = torch.distributed.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        timeout = backend.options._timeout.total_seconds()
        (self.out / f"timeout-{trainer.global_rank}.txt").write_text(repr(timeout))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_timeout_reaches_the_process_group(tmp_path: Path, mode: str) -> None:
    """The strategy's `timeout` argument is the timeout of the process group on every rank (else 30 minutes)."""
    strategy = TokenMeanDDPStrategy(mode=mode, timeout=COLLECTIVE_TIMEOUT, **FORK)  # type: ignore[arg-type]
    callbacks = [ProcessGroupTimeout(tmp_path)]
    fit(TokenModule(data()), strategy, tmp_path, accumulate_grad_batches=ACCUMULATE, callbacks=callbacks)
    timeouts = [float((tmp_path / f"timeout-{rank}.txt").read_text()) for rank in (0, 1)]
    assert timeouts == [COLLECTIVE_TIMEOUT.total_seconds()] * 2, timeouts


@pytest.mark.distributed
@pytest.mark.slow
def test_stalled_rank_times_out(tmp_path: Path) -> None:
    """End to end: rank 1 stops answering inside the first window; rank 0 fails in that window's collective.

    Without the timeout, rank 0 would wait for 30 minutes and `run_job` would give up after `JOB_TIMEOUT`: a job that
    ends with rank 0's timeout error ended on the strategy's 5 s. One mode: both modes' collectives run on the group
    whose timeout `test_timeout_reaches_the_process_group` reads. Forked workers, so that the timeout does not also
    have to cover the children's imports at the rendezvous.
    """
    args = ["--mode", "lookahead", "--start-method", "fork", "--rank1", "stall", "--timeout", str(STALL_TIMEOUT)]
    with pytest.raises(subprocess.CalledProcessError, match=r"returned non-zero exit status 1\b"):
        run_job([script(tmp_path, *args)], tmp_path / "logs")
    assert (tmp_path / "lookahead" / "rank1_left.txt").exists(), "rank 1 never reached the batch where it stalls"
    error = (tmp_path / "lookahead" / "error-launcher.txt").read_text()
    assert re.search(r"Process 0 terminated with the following error[\s\S]*timeout", error, re.IGNORECASE), error
