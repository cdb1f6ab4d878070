"""``TokenMeanAccumulator`` across passes as LitGPT's loops leave and resume them (issue 22, the Fabric items).

Each exact result is compared with the float64 plain-torch reference (``_harness.reference_steps`` over the windows
of the batches the loop trains, imports nothing from token_mean) at 1e-12, beside a control that misses: the same
loop with what the package now does undone (a checkpoint that says position 0, a sampler epoch left at 0, ...).
Workers are forked (Fabric's ``DDPStrategy``) with a 15 s process-group timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from _fabric import data_rank, full_state, launched, plain_loop, rank_batches, setup, shifted_count, shifted_loss
from _fabric_loop import FABRICS, MISSES, ddp, ragged, reference
from _harness import EXACT, MODES, Batch, ListDataset, lightning_steps, reference_steps, relative_error
from lightning.fabric import Fabric
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from token_mean import count_shifted_labels
from token_mean.fabric import TokenMeanAccumulator

K = 2


class CycleIterator:
    """LitGPT's ``litgpt.utils.CycleIterator`` (0.5.13): the loader restarted at its end, forever."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self.epoch = 0
        self._iterator: Iterator[Any] | None = None

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.iterable)
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.iterable)
            self.epoch += 1
            return next(self._iterator)

    def __iter__(self) -> CycleIterator:
        return self


def cycled(data: Sequence[Sequence[Batch]], micro_batches: int) -> list[list[Batch]]:
    """Each rank's first ``micro_batches`` batches of its loader cycled (what a CycleIterator yields)."""
    return [[rank[i % len(rank)] for i in range(micro_batches)] for rank in data]


def accumulator_for(fabric: Fabric, model: Any, mode: str) -> TokenMeanAccumulator:
    return TokenMeanAccumulator(fabric, model, accumulate=K, mode=mode, count_fn=count_shifted_labels)


def train_on(fabric: Fabric, model: Any, optimizer: Any, accumulator: TokenMeanAccumulator, batch: Batch,
             set_to_none: bool = True) -> bool:
    """One micro-batch of LitGPT's loop with the accumulator; True when it ended a window (the optimizer stepped)."""
    with fabric.no_backward_sync(model, enabled=accumulator.accumulating):
        accumulator.backward(shifted_loss(model, batch))
    if accumulator.accumulating:
        return False
    accumulator.finish()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return True


# ---------------------------------------------------------------------------------------------------------------
# item 2: the checkpoint saved after leaving the loop (LitGPT's pretrain: `max_iters`, then save)
# ---------------------------------------------------------------------------------------------------------------


def pretrain(fabric: Fabric, data: list[list[Batch]], mode: str, path: Path, max_iters: int, resume: bool,
             break_at: str, forget_position: bool = False) -> dict[str, Any]:
    """LitGPT's ``pretrain.fit`` shape: ``for batch in accumulator.batches(CycleIterator(loader))``, leaving at
    ``max_iters`` micro-batches (``break_at="top"``: the check opens the body, as LitGPT's does; ``"bottom"``: after
    the step), then ``fabric.save`` of the model, optimizer, accumulator state and ``iter_num``. ``resume`` loads
    that checkpoint first; ``forget_position``: the state's position set to 0, what it said before (the control)."""
    model, optimizer = setup(fabric)
    accumulator = accumulator_for(fabric, model, mode)
    iter_num = 0
    if resume:
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "accumulator": None, "iter_num": 0}
        fabric.load(path, state)
        saved = state["accumulator"]
        accumulator.load_state_dict({**saved, "position": 0} if forget_position else saved)
        iter_num = state["iter_num"]
    for batch in accumulator.batches(CycleIterator(rank_batches(fabric, data, "sized"))):
        if break_at == "top" and iter_num >= max_iters:
            break
        iter_num += 1
        train_on(fabric, model, optimizer, accumulator, batch)
        if break_at == "bottom" and iter_num >= max_iters:
            break
    saved_state = accumulator.state_dict()
    if not resume:
        fabric.save(path, {"model": model, "optimizer": optimizer, "accumulator": saved_state, "iter_num": iter_num})
    return {"params": full_state(model), "position": saved_state["position"]}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("break_at", ["top", "bottom"])
def test_a_checkpoint_saved_after_leaving_a_cycled_loop_resumes_where_it_stopped(
    tmp_path: Path, mode: str, break_at: str
) -> None:
    """Ranks of 3 and 5 batches cycled, K = 2: a run leaves at ``max_iters=4`` (2 windows) and saves; a fresh run
    resumes with ``max_iters=10``. The state records position 4, and the resumed run equals the uninterrupted one and
    the reference over 5 windows of the cycled stream. Control: the same resume from a state that says position 0
    retrains the stream's first batches and misses."""
    data = [rank[:length] for rank, length in zip(ragged(2, 5, seed=61), (3, 5), strict=True)]
    expected, _ = reference_steps_of(cycled(data, 10))
    path = tmp_path / "checkpoint"
    whole = launched(ddp(), pretrain, data, mode, tmp_path / "unused", 10, False, break_at)
    assert relative_error(whole["params"], expected) < EXACT
    first = launched(ddp(), pretrain, data, mode, path, 4, False, break_at)
    assert first["position"] == 4
    resumed = launched(ddp(), pretrain, data, mode, path, 10, True, break_at)
    assert relative_error(resumed["params"], expected) < EXACT
    assert relative_error(resumed["params"], whole["params"]) < EXACT
    forgot = launched(ddp(), pretrain, data, mode, path, 10, True, break_at, True)
    assert relative_error(forgot["params"], expected) > MISSES


def reference_steps_of(data: Sequence[Sequence[Batch]]) -> tuple[Any, list[float]]:
    """The reference over one pass of ``data`` (per-rank lists), windows of K."""
    return reference(data, K)


@pytest.mark.parametrize("mode", MODES)
def test_saving_after_a_pass_left_inside_a_window_raises(mode: str) -> None:
    """A pass left after its third micro-batch (inside window 2): ``state_dict()`` raises naming the batch and the
    fix, before any checkpoint is written. Control: left after its fourth (a boundary), it saves position 4."""
    fabric = Fabric(accelerator="cpu", devices=1)
    data = ragged(1, 6, seed=62)
    for leave_after, outcome in ((3, "raises"), (4, "saves")):
        model, optimizer = setup(fabric)
        accumulator = accumulator_for(fabric, model, mode)
        for index, batch in enumerate(accumulator.batches(CycleIterator(data[0]))):
            train_on(fabric, model, optimizer, accumulator, batch)
            if index + 1 == leave_after:
                break
        if outcome == "saves":
            assert accumulator.state_dict()["position"] == 4
            continue
        with pytest.raises(RuntimeError, match=r"`accumulator\.state_dict\(\)` after a pass of"
                                               r" `accumulator\.batches\(\.\.\.\)` was left inside a window \(at batch"
                                               r" 2\).*Leave the loop at a window boundary"):
            accumulator.state_dict()


# ---------------------------------------------------------------------------------------------------------------
# item 6: gradients zeroed in place after a pass was left are no partial window
# ---------------------------------------------------------------------------------------------------------------


def left_then_zeroed(fabric: Fabric, data: list[list[Batch]], mode: str, leave: str) -> dict[str, Tensor]:
    """A first pass left at a window boundary (``leave="boundary"``: the next window's first batch was yielded,
    LitGPT's ``max_iters`` check, no backward) or inside a window (``"inside"``: after that batch's backward);
    ``optimizer.zero_grad(set_to_none=False)``; then a whole second pass."""
    model, optimizer = setup(fabric)
    accumulator = accumulator_for(fabric, model, mode)
    for index, batch in enumerate(accumulator.batches(data[data_rank(fabric)])):
        if index == K and leave == "boundary":
            break
        train_on(fabric, model, optimizer, accumulator, batch, set_to_none=False)
        if index == K:
            break
    optimizer.zero_grad(set_to_none=False)
    for batch in accumulator.batches(data[data_rank(fabric)]):
        train_on(fabric, model, optimizer, accumulator, batch, set_to_none=False)
    return full_state(model)


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("leave", ["boundary", "inside"])
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_gradients_zeroed_in_place_after_leaving_a_pass(mode: str, leave: str, layout: str) -> None:
    """Rank 1 has 1 batch to rank 0's 4 (its batch 2, where the pass is left inside a window, is a filler: its local
    gradient is all zeros, rank 0's is not, and both ranks must still decide alike). The second pass runs on both
    ranks and the result is the reference over window 1 of the first pass, then the whole second pass. Control: the
    reference without the first window misses (that window did train), and without the zeroing a pass left inside a
    window raises (``test_fabric_misuse.test_a_pass_left_mid_window_then_a_new_pass``). FSDP2 keeps the partial
    gradient unsharded inside, where ``zero_grad`` does not reach: the accumulator drops it (kept, the run ends 0.3
    to 0.6 off)."""
    data = ragged(2, 4, seed=63)
    data[1] = data[1][:1]
    steps = lightning_steps(data, K)

    loss_sum = lambda net, batch: shifted_loss(net, batch, "sum")  # noqa: E731
    expected, _ = reference_steps(steps[:1] + steps, loss_sum=loss_sum, count=shifted_count)
    second_pass_alone, _ = reference_steps(steps, loss_sum=loss_sum, count=shifted_count)
    params = launched(FABRICS[layout](), left_then_zeroed, data, mode, leave)
    assert relative_error(params, expected) < EXACT
    assert relative_error(params, second_pass_alone) > MISSES


# ---------------------------------------------------------------------------------------------------------------
# item 1: validation inside the training loop while this rank's batch is a filler
# ---------------------------------------------------------------------------------------------------------------


def train_and_validate(fabric: Fabric, data: list[list[Batch]], validation: list[Batch], mode: str,
                       old_lifetime: bool) -> list[dict[str, Any]]:
    """The loop with LitGPT's validation after each optimizer step: a ``TokenMeanLoss`` over this rank's share of
    ``validation`` (every other batch). ``old_lifetime``: the validation runs inside the filler mark of the batch
    in flight, as when the mark covered the whole loop body (the control)."""
    from token_mean import TokenMeanLoss

    model, optimizer = setup(fabric)
    accumulator = accumulator_for(fabric, model, mode)
    steps = []
    for batch in accumulator.batches(data[data_rank(fabric)]):
        filler = accumulator.is_filler_batch  # from the yield to the backward
        if not train_on(fabric, model, optimizer, accumulator, batch):
            continue
        metric = TokenMeanLoss().to(fabric.device)
        mark = _old_mark(filler) if old_lifetime else contextlib.nullcontext()
        with mark, torch.no_grad():
            for val_batch in validation[fabric.global_rank::2]:
                metric.update(shifted_loss(model, val_batch), shifted_count(val_batch))
        value = float(metric.compute())
        with metric.sync_context():
            count = float(metric.count)
        steps.append({"loss": value, "count": count, "params": full_state(model), "filler": filler,
                      "after_backward": accumulator.is_filler_batch})
    return steps


class _Marked:
    def __init__(self, filler: bool) -> None:
        self.is_filler = filler


@contextlib.contextmanager
def _old_mark(filler: bool) -> Iterator[None]:
    """The filler mark over the whole loop body, validation included (its lifetime before the fix)."""
    import weakref

    from token_mean import _window

    marked = _Marked(filler)
    _window._current = weakref.ref(marked)  # type: ignore[assignment]
    try:
        yield
    finally:
        _window._current = None


def validation_loss(params: dict[str, Tensor], batches: list[Batch]) -> float:
    """The float64 token mean over every validation batch at ``params`` (imports nothing from token_mean)."""
    from _harness import TokenNet

    net = TokenNet()
    net.load_state_dict(params)
    with torch.no_grad():
        total = sum(shifted_count(batch) for batch in batches)
        return float(sum(shifted_loss(net, batch, "sum") for batch in batches) / total)


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_validation_after_a_step_whose_last_batch_is_a_filler_counts_every_rank(mode: str) -> None:
    """The issue's shape: 10 and 9 items in batches of 3 (4 batches on rank 0, 3 on rank 1), K = 2, validation
    after each step. Rank 1's last batch of step 2 is a filler, but its validation items count: every step's
    validation loss is the float64 token mean over all validation batches at that step's parameters, and its count
    is theirs. Control: the same validation inside the filler's mark (the mark's old lifetime) drops rank 1's items
    at step 2 and misses."""
    from _fabric_loop import validation_batches

    data = ragged(2, 4, seed=64)
    data[1] = data[1][:3]
    validation = validation_batches()
    total = float(sum(shifted_count(batch) for batch in validation))
    steps = launched(ddp(), train_and_validate, data, validation, mode, False)
    assert [step["filler"] for step in steps] == [False, False]  # rank 0's view; rank 1's step 2 ends on a filler
    assert not any(step["after_backward"] for step in steps)
    assert relative_error(steps[-1]["params"], reference(data, K)[0]) < EXACT
    for step in steps:
        assert step["count"] == total
        assert step["loss"] == pytest.approx(validation_loss(step["params"], validation), rel=EXACT)
    control = launched(ddp(), train_and_validate, data, validation, mode, True)
    assert control[1]["count"] < total
    assert abs(control[1]["loss"] - validation_loss(control[1]["params"], validation)) > MISSES


# ---------------------------------------------------------------------------------------------------------------
# item 3: resuming in the middle of pass 2 (the sampler's epoch), and on another number of processes
# ---------------------------------------------------------------------------------------------------------------

SEED = 7


def shuffled_loader(fabric: Fabric, batches: list[Batch]) -> tuple[Any, DistributedSampler[Batch]]:
    """A loader from ``fabric.setup_dataloaders`` over a shuffling ``DistributedSampler``: its order is the epoch's."""
    dataset = ListDataset(batches)
    sampler = DistributedSampler(dataset, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=True,
                                 seed=SEED)
    loader = DataLoader(dataset, batch_size=None, sampler=sampler)
    return fabric.setup_dataloaders(loader, use_distributed_sampler=False), sampler


def epochs_of(fabric: Fabric, batches: list[Batch], mode: str, path: Path, phase: str, save_after: int = 0,
              forget_epoch: bool = False) -> dict[str, Tensor]:
    """Two passes with the docs' recipe (``sampler.set_epoch(pass)`` before each). ``phase``: "whole" trains both;
    "first" saves after window ``save_after`` (counted over both passes) and stops, "between" saves after pass 1 and
    stops; "resumed" loads that checkpoint and trains on (``forget_epoch``: the saved loader epoch dropped, the
    control)."""
    model, optimizer = setup(fabric)
    accumulator = accumulator_for(fabric, model, mode)
    loader, sampler = shuffled_loader(fabric, batches)
    first_pass = 0
    if phase == "resumed":
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "accumulator": None, "pass": 0}
        fabric.load(path, state)
        saved = state["accumulator"]
        accumulator.load_state_dict({**saved, "loader_epoch": None} if forget_epoch else saved)
        first_pass = state["pass"]
    windows = 0
    for pass_ in range(first_pass, 2):
        sampler.set_epoch(pass_)
        for batch in accumulator.batches(loader):
            windows += train_on(fabric, model, optimizer, accumulator, batch)
            if phase == "first" and windows == save_after and not accumulator.accumulating:
                fabric.save(path, {"model": model, "optimizer": optimizer, "accumulator": accumulator.state_dict(),
                                   "pass": pass_})
                return full_state(model)
        if phase == "between":
            fabric.save(path, {"model": model, "optimizer": optimizer, "accumulator": accumulator.state_dict(),
                               "pass": pass_ + 1})
            return full_state(model)
    return full_state(model)


def epoch_reference(batches: list[Batch], ranks: int) -> dict[str, Tensor]:
    """The float64 reference over two passes, each in the order torch's ``DistributedSampler`` gives its epoch."""
    steps = []
    for epoch in range(2):
        per_rank = []
        for rank in range(ranks):
            sampler = DistributedSampler(ListDataset(batches), num_replicas=ranks, rank=rank, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            per_rank.append([batches[index] for index in sampler])
        steps += lightning_steps(per_rank, K)
    loss_sum = lambda net, batch: shifted_loss(net, batch, "sum")  # noqa: E731
    return reference_steps(steps, loss_sum=loss_sum, count=shifted_count)[0]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_resuming_in_the_middle_of_pass_2_keeps_the_samplers_epoch(tmp_path: Path, mode: str) -> None:
    """12 batches shuffled by a ``DistributedSampler`` over 2 ranks (6 each, 3 windows a pass), saved after window 4
    (the middle of pass 2): the resumed run reads pass 2 in epoch 1's order, as the uninterrupted run did, and both
    equal the reference. Control: the same resume without the saved loader epoch (Fabric's loader starts its pass
    counter at 0 in a new process and overrides ``set_epoch``) reads epoch 0's order and misses."""
    batches = [batch for rank in ragged(2, 6, seed=65) for batch in rank]
    expected = epoch_reference(batches, 2)
    path = tmp_path / "checkpoint"
    whole = launched(ddp(), epochs_of, batches, mode, path, "whole")
    assert relative_error(whole, expected) < EXACT
    launched(ddp(), epochs_of, batches, mode, path, "first", 4)
    resumed = launched(ddp(), epochs_of, batches, mode, path, "resumed")
    assert relative_error(resumed, expected) < EXACT
    forgot = launched(ddp(), epochs_of, batches, mode, path, "resumed", 0, True)
    assert relative_error(forgot, expected) > MISSES


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_resuming_a_pass_on_another_number_of_processes_is_refused(tmp_path: Path, mode: str) -> None:
    """A checkpoint written by 2 processes in the middle of pass 1 (after window 1), resumed on one: ``load_state_dict``
    raises (the same state on every rank: the same error), naming both numbers and the fix. Control: a checkpoint
    written between passes (position 0) resumes on one process and trains pass 2."""
    batches = [batch for rank in ragged(2, 6, seed=66) for batch in rank]
    path = tmp_path / "checkpoint"
    launched(ddp(), epochs_of, batches, mode, path, "first", 1)
    with pytest.raises(ValueError, match=r"the checkpoint was written in the middle of a pass by 2 processes.*resumed"
                                         r" with 1 processes.*Resume with 2 processes, or from a checkpoint written"
                                         r" between passes"):
        epochs_of(Fabric(accelerator="cpu", devices=1), batches, mode, path, "resumed")
    between = launched(ddp(), epochs_of, batches, mode, path, "between")
    state = torch.load(path, weights_only=False)["accumulator"]
    assert (state["position"], state["passes"]) == (0, 1), state
    resumed = epochs_of(Fabric(accelerator="cpu", devices=1), batches, mode, path, "resumed")
    assert relative_error(resumed, between) > MISSES  # it trained pass 2


# ---------------------------------------------------------------------------------------------------------------
# item 7: a one-batch epoch cycled yields the same unchanged tensors again, which is no refilled buffer
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_a_one_batch_epoch_under_cycle_iterator(tmp_path: Path, mode: str) -> None:
    """Each rank's loader holds one batch (``batch_size=None`` over stored tensors: every epoch yields the very same
    tensors), cycled by LitGPT's CycleIterator for 6 micro-batches, K = 2: every window holds that batch twice, read
    ahead beside itself. Lookahead and deferred are exact. Control: LitGPT's own loop over the same stream misses."""
    data = [rank[:1] for rank in ragged(2, 1, seed=67)]
    stream = cycled(data, 6)
    expected, _ = reference(stream, K)
    result = launched(ddp(), pretrain, data, mode, tmp_path / "checkpoint", 6, False, "top")
    assert relative_error(result["params"], expected) < EXACT
    assert relative_error(launched(ddp(), plain_loop, stream, K), expected) > MISSES


# ---------------------------------------------------------------------------------------------------------------
# item 4: FabricMonitor after a resume numbers its windows on from the checkpoint's
# ---------------------------------------------------------------------------------------------------------------


def monitored_resume(fabric: Fabric, data: list[list[Batch]], mode: str, path: Path, phase: str, record: Path,
                     reference_trace: Path | None = None, forget_windows: bool = False) -> Any:
    """One pass with ``FabricMonitor(record=..., reference=..., on_divergence="log")``: ``phase`` "whole" trains
    it, "first" saves after window 2 and stops, "resumed" loads that checkpoint and trains on (``forget_windows``:
    the state's window count set to 0, what the monitor numbered from before; the control). The first divergence."""
    from token_mean.fabric_monitor import FabricMonitor

    model, optimizer = setup(fabric)
    monitor = FabricMonitor(record=record, reference=reference_trace, on_divergence="log")
    accumulator = TokenMeanAccumulator(fabric, model, accumulate=K, mode=mode, count_fn=count_shifted_labels,
                                       monitor=monitor)
    if phase == "resumed":
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "accumulator": None}
        fabric.load(path, state)
        saved = state["accumulator"]
        accumulator.load_state_dict({**saved, "windows": 0} if forget_windows else saved)
    windows = 0
    for batch in accumulator.batches(data[data_rank(fabric)]):
        windows += train_on(fabric, model, optimizer, accumulator, batch)
        if phase == "first" and windows == 2 and not accumulator.accumulating:
            fabric.save(path, {"model": model, "optimizer": optimizer, "accumulator": accumulator.state_dict()})
            break
    monitor.close()
    divergence = monitor.first_divergence
    return None if divergence is None else (divergence.step, divergence.quantity)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_the_monitor_numbers_a_resumed_runs_windows_on(tmp_path: Path, mode: str) -> None:
    """6 batches per rank (3 windows), saved after window 2, resumed: the resumed run's trace holds step 2 only, with
    the float64 reference's N, loss, gradient norm and parameter norm of window 3, and its comparison with the
    uninterrupted run's trace finds no divergence. Control: numbered from 0 again (the saved window count dropped),
    the same run compares its window 3 with the reference's step 0 and reports a divergence there."""
    from _fabric_loop import monitor_data, trajectory

    from token_mean._trace import read_trace

    data = monitor_data()
    expected = trajectory(data)
    path, whole = tmp_path / "checkpoint", tmp_path / "whole.csv"
    assert launched(ddp(), monitored_resume, data, mode, path, "whole", whole) is None
    launched(ddp(), monitored_resume, data, mode, path, "first", tmp_path / "first.csv")
    resumed = tmp_path / "resumed.csv"
    assert launched(ddp(), monitored_resume, data, mode, path, "resumed", resumed, whole) is None
    trace = read_trace(resumed)
    assert sorted(trace) == [2]
    assert trace[2]["global_count"] == expected[2]["global_count"]
    for column in ("loss", "grad_norm", "param_norm"):
        assert trace[2][column] == pytest.approx(expected[2][column], rel=EXACT), column
    control = launched(ddp(), monitored_resume, data, mode, path, "resumed", tmp_path / "control.csv", whole, True)
    assert control is not None and control[0] == 0


# ---------------------------------------------------------------------------------------------------------------
# item 5: another K with a new accumulator on the same DDP model
# ---------------------------------------------------------------------------------------------------------------


def two_accumulators(fabric: Fabric, data: list[list[Batch]], mode: str, second_k: int) -> dict[str, Tensor]:
    """Pass 1 with K = 2, then pass 2 with a new accumulator of K = ``second_k`` on the same model (deferred: DDP
    takes one communication hook per model, for good)."""
    model, optimizer = setup(fabric)
    for accumulate in (K, second_k):
        accumulator = TokenMeanAccumulator(fabric, model, accumulate=accumulate, mode=mode,
                                           count_fn=count_shifted_labels)
        for batch in accumulator.batches(data[data_rank(fabric)]):
            train_on(fabric, model, optimizer, accumulator, batch)
        del accumulator  # the hook must follow the new mode, not the dropped one
    return full_state(model)


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_a_new_accumulator_with_another_k_on_the_same_model(mode: str) -> None:
    """6 ragged batches per rank, pass 1 in windows of 2 and pass 2 in windows of 3: the reference over those
    windows. Control: the same loop keeping K = 2 misses it (the second K did change the windows)."""
    data = ragged(2, 6, seed=68)
    loss_sum = lambda net, batch: shifted_loss(net, batch, "sum")  # noqa: E731
    steps = lightning_steps(data, K) + lightning_steps(data, 3)
    expected, _ = reference_steps(steps, loss_sum=loss_sum, count=shifted_count)
    assert relative_error(launched(ddp(), two_accumulators, data, mode, 3), expected) < EXACT
    assert relative_error(launched(ddp(), two_accumulators, data, mode, K), expected) > MISSES


def with_own_comm_hook(fabric: Fabric) -> str:
    """Deferred on a model that already has the user's own DDP communication hook: every rank's message."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model, _ = setup(fabric)
    model._forward_module.register_comm_hook(None, allreduce_hook)  # the DistributedDataParallel
    try:
        accumulator_for(fabric, model, "deferred")
    except ValueError as error:
        message = str(error)
    else:
        message = "accepted"
    messages = [""] * fabric.world_size
    torch.distributed.all_gather_object(messages, message)
    return "\n".join(messages)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_deferred_on_a_model_with_its_own_comm_hook_says_what_to_do() -> None:
    """Control: the test above, where the accumulator's own hook is installed once and followed."""
    messages = launched(ddp(), with_own_comm_hook).split("\n")
    assert len(messages) == 2 and len(set(messages)) == 1, messages
    assert "the model already has one" in messages[0] and "use `mode='lookahead'`" in messages[0], messages


# ---------------------------------------------------------------------------------------------------------------
# messages name the front end in use
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trace", ["missing.csv", "folder"])
def test_fabric_monitor_messages_name_fabric_monitor(tmp_path: Path, trace: str) -> None:
    """A reference trace that is missing or a directory: the message says how to record one with
    ``FabricMonitor(record=...)``. Control: the Trainer's monitor says ``DenominatorMonitor`` (test_callback.py)."""
    from token_mean.fabric_monitor import FabricMonitor

    (tmp_path / "folder.csv").mkdir()
    path = tmp_path / ("missing.csv" if trace == "missing.csv" else "folder.csv")
    with pytest.raises((FileNotFoundError, IsADirectoryError), match=r"`FabricMonitor\(record=") as raised:
        FabricMonitor(reference=path)
    assert "DenominatorMonitor" not in str(raised.value)
