"""TokenMeanDDPStrategy against the plain-torch unpartitioned reference (float64, relative 1e-12).

Every case but one also runs with plain ``DDPStrategy``, which must miss the reference: ranks or micro-batches hold
different numbers of valid tokens there, so the tests can fail. The exception, one micro-batch on one device, is a case
where plain DDP is exact and has no control.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _harness import (
    EXACT,
    FORK,
    LR,
    MODES,
    Batch,
    ListDataset,
    StreamDataset,
    TokenModule,
    TokenNet,
    constant,
    empty_like,
    fit,
    initial_state,
    make_optimizer,
    ragged_batches,
    reference,
    relative_error,
    strategy_for,
    token_loss,
    windows_of,
)
from _ranks import raises_everywhere
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import Tensor
from torch.utils.data import DataLoader

from token_mean import TokenMeanDDPStrategy

pytestmark = pytest.mark.core  # in `make test-fast`


def with_empty(data: list[list[dict[str, Tensor]]], cells: list[tuple[int, int]]) -> list[list[dict[str, Tensor]]]:
    data = [list(rank) for rank in data]
    for rank, index in cells:
        data[rank][index] = empty_like(data[rank][index])
    return data


# (name, devices, K, batches per rank, empty (rank, batch) cells, extra Trainer kwargs, epochs)
CASES: list[tuple[str, int, int, int, list[tuple[int, int]], dict[str, Any], int]] = [
    ("P1-K1", 1, 1, 5, [], {}, 1),
    ("P1-K3-partial", 1, 3, 7, [], {}, 1),
    ("P2-K1", 2, 1, 5, [], {}, 1),
    ("P2-K3-partial-2-epochs", 2, 3, 7, [], {}, 2),
    ("masked-micro-batch", 2, 3, 6, [(0, 1), (1, 4)], {}, 1),
    ("empty-rank-window", 2, 3, 6, [(1, 0), (1, 1), (1, 2)], {}, 1),
    ("empty-global-window", 2, 2, 6, [(0, 2), (0, 3), (1, 2), (1, 3)], {}, 1),
    ("limit-train-batches", 2, 3, 9, [], {"limit_train_batches": 5}, 2),
    ("max-steps-mid-epoch", 2, 2, 9, [], {"max_steps": 3, "max_epochs": -1}, 1),
]


def run_case(
    tmp_path: Path, mode: str, name: str, devices: int, k: int, batches: int, empty: list[tuple[int, int]],
    trainer_kwargs: dict[str, Any], epochs: int,
) -> tuple[float, list[dict[str, Any]], list[float]]:
    """(relative parameter error against the reference, the strategy's window stats, the reference's counts)."""
    data = with_empty(ragged_batches(devices, batches, seed=len(name)), empty)
    kwargs = {"max_epochs": epochs, **trainer_kwargs}
    params, windows = fit(TokenModule(data), strategy_for(mode), tmp_path, devices, accumulate_grad_batches=k, **kwargs)
    expected, counts = reference(
        data, constant(k), epochs, trainer_kwargs.get("limit_train_batches"), trainer_kwargs.get("max_steps")
    )
    return relative_error(params, expected), windows, counts


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "devices", "k", "batches", "empty", "trainer_kwargs", "epochs"), CASES)
def test_matches_unpartitioned_reference(
    tmp_path: Path, mode: str, name: str, devices: int, k: int, batches: int, empty: list[tuple[int, int]],
    trainer_kwargs: dict[str, Any], epochs: int,
) -> None:
    error, windows, counts = run_case(tmp_path, mode, name, devices, k, batches, empty, trainer_kwargs, epochs)
    assert error < EXACT, f"{mode}/{name}: relative parameter error {error:.3e}"
    assert [w["global_count"] for w in windows] == counts
    assert all(sum(w["rank_counts"]) == w["global_count"] for w in windows)
    assert [w["skipped"] for w in windows] == [c == 0 for c in counts]


# P1-K1 has no plain control: with one micro-batch on one device, plain DDP's mean of means is the token mean, so
# such a control could not fail. Every other case puts micro-batches with different token counts in one step.
PLAIN_CASES = [case for case in CASES if case[1] * case[2] > 1]


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "devices", "k", "batches", "empty", "trainer_kwargs", "epochs"), PLAIN_CASES)
def test_plain_ddp_misses_the_reference(
    tmp_path: Path, name: str, devices: int, k: int, batches: int, empty: list[tuple[int, int]],
    trainer_kwargs: dict[str, Any], epochs: int,
) -> None:
    """The control of every case above but P1-K1: plain DDP optimizes a mean of means and lands elsewhere."""
    error, _, _ = run_case(tmp_path, "plain", name, devices, k, batches, empty, trainer_kwargs, epochs)
    assert error > 1e-6, f"plain DDP matched the token mean in case {name}: the test could not fail"


@pytest.mark.parametrize("mode", MODES)
def test_empty_windows_warn_once(tmp_path: Path, mode: str) -> None:
    """One process (no fork, so the warnings reach this one), K = 2: windows 0 and 2 of 3 hold no valid item.

    Both are skipped and counted, and the user is warned once, not once per empty window.
    """
    data = with_empty(ragged_batches(1, 6, seed=9), [(0, 0), (0, 1), (0, 4), (0, 5)])
    strategy = TokenMeanDDPStrategy(mode=mode, process_group_backend="gloo")  # type: ignore[arg-type]
    module = TokenModule(data)
    with pytest.warns(UserWarning) as caught:
        params, windows = fit(module, strategy, tmp_path, devices=1, accumulate_grad_batches=2)
    empty_window_warnings = [w for w in caught if "no valid items on any rank (N = 0)" in str(w.message)]
    assert len(empty_window_warnings) == 1, [str(w.message) for w in caught]
    assert strategy.skipped_steps == 2
    assert module.trainer.global_step == 3  # Lightning counts the skipped steps
    expected, counts = reference(data, constant(2))
    assert counts[0] == counts[2] == 0.0 and counts[1] > 0
    assert [w["skipped"] for w in windows] == [True, False, True]
    assert relative_error(params, expected) < EXACT


GAMMA = 0.5  # the step-wise LR schedule of the test below: the LR halves at every optimizer step Lightning counts


class Scheduled(TokenModule):
    """SGD with a step-wise StepLR; rank 0 writes (global_step, LR) at the end of every batch."""

    def __init__(self, data: list[list[dict[str, Tensor]]], out: Path) -> None:
        super().__init__(data)
        self.out = out
        self.seen: list[tuple[int, float]] = []

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((self.trainer.global_step, self.trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            (self.out / "steps.json").write_text(json.dumps(self.seen))


def scheduled_reference(data: list[list[dict[str, Tensor]]], accumulate: int) -> dict[str, Tensor]:
    """Plain torch: a window with N = 0 leaves parameters and momentum alone, and the scheduler still steps."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    for window in windows_of(len(data[0]), accumulate):
        step_batches = [rank[i] for rank in data for i in window]
        total = sum(int((b["labels"] != -100).sum()) for b in step_batches)
        if total > 0:
            optimizer.zero_grad()
            loss = sum(token_loss(net, b, "sum") for b in step_batches) / total
            assert isinstance(loss, Tensor)
            loss.backward()
            optimizer.step()
        scheduler.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_empty_window_advances_global_step_and_lr_schedule(tmp_path: Path, mode: str) -> None:
    """docs/guarantees.md: a window with N = 0 is skipped, but Lightning's `global_step` and a step-wise LR scheduler
    still advance on it. K = 2, 2 ranks: window 1 of 3 holds no valid item on any rank."""
    data = with_empty(ragged_batches(2, 6, seed=9), [(0, 2), (0, 3), (1, 2), (1, 3)])
    params, windows = fit(Scheduled(data, tmp_path), strategy_for(mode), tmp_path, accumulate_grad_batches=2)
    assert [w["skipped"] for w in windows] == [False, True, False]
    seen = [tuple(step) for step in json.loads((tmp_path / "steps.json").read_text())]
    # (global_step, LR) after each batch: the skipped window (batches 2, 3) counts a step and halves the LR
    assert seen == [(0, LR), (1, LR * GAMMA), (1, LR * GAMMA), (2, LR * GAMMA**2), (2, LR * GAMMA**2),
                    (3, LR * GAMMA**3)]
    assert relative_error(params, scheduled_reference(data, 2)) < EXACT


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_iterable_dataset(tmp_path: Path, mode: str) -> None:
    """An unsized loader: the last window's end is only known when the stream runs out."""
    data = ragged_batches(2, 8, seed=3)
    params, _ = fit(TokenModule(data, iterable=True), strategy_for(mode), tmp_path, accumulate_grad_batches=3)
    expected, _ = reference(data, constant(3))
    assert relative_error(params, expected) < EXACT


# ---------------------------------------------------------------------------------------------------------------
# host memory: lookahead reads at most K batches ahead of the one in training, deferred nothing beyond Lightning's own
# ---------------------------------------------------------------------------------------------------------------


class _CountingIterator:
    """The loader's iterator; at every batch it yields, the number of batches read ahead: yielded and not yet started,
    not counting the batch the loop fetches for its next step (a worker inherits the counters at zero, then counts
    its own)."""

    yielded = started = most_ahead = 0
    in_training = False  # between a batch's on_train_batch_start and its on_train_batch_end

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        counter = _CountingIterator
        counter.yielded += 1
        ahead = counter.yielded - counter.started - (0 if counter.in_training else 1)
        counter.most_ahead = max(counter.most_ahead, ahead)
        return batch


class CountingLoader(DataLoader[dict[str, Tensor]]):
    def __iter__(self) -> Any:
        return _CountingIterator(super().__iter__())


class CountedReads(TokenModule):
    def __init__(self, data: list[list[dict[str, Tensor]]], out: Path, iterable: bool) -> None:
        super().__init__(data, iterable=iterable)
        self.out = out

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        rank_batches = self.data[self.global_rank]
        return CountingLoader(StreamDataset(rank_batches) if self.iterable else ListDataset(rank_batches),
                              batch_size=None)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        _CountingIterator.started += 1
        _CountingIterator.in_training = True

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        _CountingIterator.in_training = False

    def on_train_end(self) -> None:
        (self.out / f"ahead{self.global_rank}.txt").write_text(str(_CountingIterator.most_ahead))


# (method, loader, K): what each holds ahead at most. Lightning's fetcher itself reads one batch ahead of a stream
# (plain DDP holds 1 there, 0 on a sized loader); lookahead's rolling read-ahead reaches K ahead at every window's last
# micro-batch (the whole next window) and never more, on either loader (Lightning's prefetch is one of the K).
READ_AHEAD = [
    *(("lookahead", loader, k, k) for loader in ("sized", "stream") for k in (1, 3)),
    ("deferred", "sized", 3, 0), ("deferred", "stream", 3, 1), ("plain", "sized", 3, 0), ("plain", "stream", 3, 1),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("method", "loader", "k", "most_ahead"), READ_AHEAD)
def test_batches_read_ahead(tmp_path: Path, method: str, loader: str, k: int, most_ahead: int) -> None:
    """docs/modes.md's "host memory: at most K batches read ahead" (lookahead) and "nothing extra" (deferred), exactly:
    the most batches a rank's loader yielded beyond the one in training is K in lookahead, and plain DDP's in
    deferred mode."""
    data = ragged_batches(2, 7, seed=12)
    module = CountedReads(data, tmp_path, iterable=loader == "stream")
    params, _ = fit(module, strategy_for(method), tmp_path, accumulate_grad_batches=k)
    assert [int((tmp_path / f"ahead{rank}.txt").read_text()) for rank in (0, 1)] == [most_ahead] * 2
    if method != "plain":
        assert relative_error(params, reference(data, constant(k))[0]) < EXACT


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_stream_shorter_than_one_window(tmp_path: Path, mode: str) -> None:
    """Two batches per rank, K = 3, two epochs: each epoch is one window padded with a filler, and it ends there (a
    stream's end is agreed at its first window's end too, with no empty windows after it)."""
    data = ragged_batches(2, 2, seed=3)
    params, windows = fit(TokenModule(data, iterable=True), strategy_for(mode), tmp_path, accumulate_grad_batches=3,
                          max_epochs=2)
    expected, counts = reference(data, constant(3), epochs=2)
    assert relative_error(params, expected) < EXACT
    assert [w["global_count"] for w in windows] == counts and [w["window_length"] for w in windows] == [3, 3]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_accumulation_schedule(tmp_path: Path, mode: str) -> None:
    """K changes per epoch through GradientAccumulationScheduler."""
    data = ragged_batches(2, 7, seed=4)
    scheduler = GradientAccumulationScheduler(scheduling={0: 3, 1: 2, 2: 4})
    params, _ = fit(TokenModule(data), strategy_for(mode), tmp_path, max_epochs=3, callbacks=[scheduler])
    expected, _ = reference(data, lambda epoch: {0: 3, 1: 2}.get(epoch, 4), epochs=3)
    assert relative_error(params, expected) < EXACT


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("as_dict", [False, True])
def test_sum_reduction(tmp_path: Path, mode: str, as_dict: bool) -> None:
    data = with_empty(ragged_batches(2, 5, seed=5), [(1, 2)])
    module = TokenModule(data, reduction="sum", as_dict=as_dict)
    strategy = strategy_for(mode, loss_reduction="sum")
    params, _ = fit(module, strategy, tmp_path, accumulate_grad_batches=2)
    expected, _ = reference(data, constant(2))
    assert relative_error(params, expected) < EXACT


# ---------------------------------------------------------------------------------------------------------------
# what Lightning shows: the progress bar and `self.log` see the user's own micro-batch loss, never the scaled one
# ---------------------------------------------------------------------------------------------------------------


class LoggedLoss(TokenModule):
    """Logs its micro-batch loss to the progress bar and, at every batch end, writes (per rank) what Lightning shows
    next to the loss plain torch computes from the same weights, and the tensor it returned as it is after backward.
    """

    def __init__(self, data: list[list[dict[str, Tensor]]], out: Path) -> None:
        super().__init__(data)
        self.out = out
        self.rows: list[dict[str, float]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = token_loss(self.net, batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False, reduce_fx="mean")
        with torch.no_grad():
            self._plain = float(token_loss(self.net, batch))  # the same weights: nothing steps inside a window
        self._returned = loss
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.rows.append({
            "plain": self._plain,
            "progress_bar": float(self.trainer.progress_bar_metrics["train_loss"]),
            "callback_metrics": float(self.trainer.callback_metrics["train_loss"]),
            "returned": float(self._returned),  # after its backward: a loss scaled in place would show here
            "outputs_times_k": float(outputs["loss"]) * self.trainer.accumulate_grad_batches,  # Lightning's copy / K
        })

    def on_train_end(self) -> None:
        (self.out / f"shown{self.global_rank}.json").write_text(json.dumps(self.rows))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_progress_bar_and_log_show_the_micro_batch_loss(tmp_path: Path, mode: str) -> None:
    """docs/guarantees.md: the progress bar and `self.log` show the micro-batch's own loss; the strategy rescales only
    what goes into `backward`, into a new tensor. K = 3 with a partial last window, micro-batches far apart in
    size, so the strategy's scale K·P·n/N (or n/D) is far from 1 on every micro-batch."""
    data = ragged_batches(2, 7, seed=13, keep=(0.9, 0.5))
    assert all(int((b["labels"] != -100).sum()) > 0 for rank in data for b in rank)  # no 0/0 mean to compare
    # check_count=False: training_step keeps its last loss for on_train_batch_end, which the check's replays rewrite
    params, _ = fit(LoggedLoss(data, tmp_path), strategy_for(mode, check_count=False), tmp_path,
                    accumulate_grad_batches=3)
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"shown{rank}.json").read_text())
        assert len(rows) == 7, rank
        for index, row in enumerate(rows):
            where = f"rank {rank}, batch {index}: {row}"
            assert row["progress_bar"] == row["callback_metrics"] == row["returned"] == row["plain"], where
            assert row["outputs_times_k"] == pytest.approx(row["plain"], rel=1e-15), where
    assert relative_error(params, reference(data, constant(3))[0]) < EXACT  # the strategy did scale the gradient


# ---------------------------------------------------------------------------------------------------------------
# a custom count defines another objective: each valid target weighs its class's weight
# ---------------------------------------------------------------------------------------------------------------

CLASS_WEIGHTS = torch.tensor([0.25, 1.0, 2.5, 0.5, 4.0, 1.5, 0.75], dtype=torch.float64)  # one per class, CLASSES = 7


def token_weights(labels: Tensor) -> Tensor:
    """Each valid target's class weight; an ignored target (-100) weighs nothing."""
    return torch.where(labels != -100, CLASS_WEIGHTS[labels.clamp(min=0)], 0.0)


def weighted_loss_sum(net: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    per_token = F.cross_entropy(
        net(batch["x"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="none"
    )
    return (token_weights(batch["labels"]).flatten() * per_token).sum()


def weighted_mean(module: TokenModule, batch: dict[str, Tensor], loss: Tensor) -> dict[str, Tensor]:
    """What the user's `training_step` returns: the micro-batch's weighted mean loss, in a dict."""
    return {"loss": weighted_loss_sum(module.net, batch) / token_weights(batch["labels"]).sum()}


def weighted_reference(data: list[list[dict[str, Tensor]]], accumulate: int) -> dict[str, Tensor]:
    """Plain torch, one process: per optimizer step, sum of w·loss over every valid target of the step over sum of w."""
    net = TokenNet()
    net.load_state_dict(initial_state())
    optimizer = make_optimizer(net.parameters())
    for window in windows_of(len(data[0]), accumulate):
        step_batches = [rank[i] for rank in data for i in window]
        total = sum(float(token_weights(b["labels"]).sum()) for b in step_batches)
        optimizer.zero_grad()
        loss = sum(weighted_loss_sum(net, b) for b in step_batches) / total
        assert isinstance(loss, Tensor)
        loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


class WeightCount:
    """``count_fn``: the sum of the micro-batch's target weights. Each forked rank appends every count to a file."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, batch: dict[str, Tensor]) -> Tensor:
        count = token_weights(batch["labels"]).sum()
        with (self.out / f"count_fn-{torch.distributed.get_rank()}.txt").open("a") as calls:
            calls.write(f"{float(count)!r}\n")
        return count


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_dict_output_and_custom_count_fn(tmp_path: Path, mode: str) -> None:
    """A class-weighted mean: the count is a float sum of weights, which the default token count would not give."""
    data = ragged_batches(2, 4, seed=6)
    expected = weighted_reference(data, 2)
    token_mean_objective, _ = reference(data, constant(2))
    assert relative_error(token_mean_objective, expected) > 1e-3, "the weights change nothing: the test could not fail"
    # the count check calls the count on the halves it replays (test_count_check.py): off, to count the strategy's
    strategy = strategy_for(mode, count_fn=WeightCount(tmp_path), check_count=False)
    module = TokenModule(data, output_fn=weighted_mean)
    params, windows = fit(module, strategy, tmp_path / "run", accumulate_grad_batches=2)
    assert relative_error(params, expected) < EXACT
    assert [w["global_count"] for w in windows] == [
        pytest.approx(sum(float(token_weights(rank[i]["labels"]).sum()) for rank in data for i in window), rel=EXACT)
        for window in windows_of(4, 2)
    ]
    for rank in (0, 1):
        calls = [float(line) for line in (tmp_path / f"count_fn-{rank}.txt").read_text().split()]
        counts = [float(token_weights(b["labels"]).sum()) for b in data[rank]]
        # once per micro-batch, in order, on every rank: deferred as `training_step` received it; lookahead as the
        # loader yielded it (read ahead), and not again for the same tensors unchanged (on the CPU, no hook)
        assert calls == counts, f"rank {rank}"


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_default_count_misses_the_weighted_objective(tmp_path: Path, mode: str) -> None:
    """The control: the same weighted means under the default count (valid tokens) optimize another objective."""
    data = ragged_batches(2, 4, seed=6)
    # the count check refuses this count (tests/test_count_check.py): off, to show what it would train
    params, _ = fit(TokenModule(data, output_fn=weighted_mean), strategy_for(mode, check_count=False), tmp_path,
                    accumulate_grad_batches=2)
    assert relative_error(params, weighted_reference(data, 2)) > 1e-6


# ---------------------------------------------------------------------------------------------------------------
# the worked example: ℓ(w; y) = ½(w − y)², w = 10, rank 0 targets [9, 9], rank 1 targets [7] * 6, SGD lr 0.1
# ---------------------------------------------------------------------------------------------------------------


class Scalar(pl.LightningModule):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(10.0, dtype=torch.float64))
        self.path = path

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return (0.5 * (self.w - batch["labels"]) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        targets = [[9.0, 9.0], [7.0] * 6][self.global_rank]
        return DataLoader([{"labels": torch.tensor(targets, dtype=torch.float64)}], batch_size=None)

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            self.path.write_text(repr(float(self.w)))


@pytest.mark.distributed
@pytest.mark.parametrize(("strategy", "expected"), [("token_mean", 9.75), ("plain", 9.8)])
def test_worked_example(tmp_path: Path, strategy: str, expected: float) -> None:
    chosen = TokenMeanDDPStrategy(**FORK) if strategy == "token_mean" else DDPStrategy(**FORK)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=chosen, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(Scalar(tmp_path / "w.txt"))
    assert float((tmp_path / "w.txt").read_text()) == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# names and errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "start_method"),
    [("ddp_token_mean", "popen"), ("ddp_token_mean_spawn", "spawn"), ("ddp_token_mean_fork", "fork")],
)
def test_registered_names(name: str, start_method: str) -> None:
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, TokenMeanDDPStrategy)
    assert trainer.strategy._start_method == start_method
    # DDP's own names still mean DDP
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy
    assert [n for n in StrategyRegistry if StrategyRegistry[n]["strategy"] is TokenMeanDDPStrategy] == [
        "ddp_token_mean", "ddp_token_mean_spawn", "ddp_token_mean_fork"
    ]


def test_ddp_arguments_pass_through() -> None:
    from datetime import timedelta

    strategy = TokenMeanDDPStrategy(
        count_fn=len, process_group_backend="gloo", timeout=timedelta(seconds=7), start_method="spawn",
        find_unused_parameters=True,
    )
    assert strategy._process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=7)
    assert strategy._start_method == "spawn"
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy.count_fn is len and strategy.mode == "lookahead" and strategy.loss_reduction == "mean"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "eager"}, ValueError, r"`mode` must be one of \('lookahead', 'deferred'\), got 'eager'"),
        ({"loss_reduction": "avg"}, ValueError, r"`loss_reduction` must be 'mean' .* or 'sum' .*, got 'avg'"),
        ({"count_fn": 3}, TypeError, r"`count_fn` must be a callable .* got int: 3"),
        ({"mode": "deferred", "ddp_comm_hook": lambda s, b: None}, ValueError, r"`ddp_comm_hook` cannot be combined"),
        ({"pad_uneven_ranks": "no"}, ValueError, r"`pad_uneven_ranks` must be True or False, got 'no'\."),
        ({"check_count": 0}, ValueError, r"`check_count` must be True or False, got 0\."),
        ({"count_fn": {"lm": None}}, TypeError, r"`count_fn\['lm'\]` is None: give each term a count"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    """The same message as the monitors' and the accumulator's for the same mistake (``_settings``)."""
    with pytest.raises(error, match=match):
        TokenMeanDDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulate_grad_batches": 2}, r"`accumulate_grad_batches=2`, which is a `Trainer` argument: pass"
         r" `accumulate_grad_batches` to the `Trainer`"),
        ({"devices": 2}, r"`devices=2`, which is a `Trainer` argument: pass `devices` to the `Trainer`"),
        ({"find_unused_parameter": True}, r"argument `find_unused_parameter=True`.*`find_unused_parameters`"),
    ],
)
def test_misplaced_arguments_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    """Without the check, DDP's constructor would fail after launch in every process ("unexpected keyword")."""
    with pytest.raises(TypeError, match=match):
        TokenMeanDDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start_method": "thread"}, r"`start_method` must be one of \('popen', 'spawn', 'fork', 'forkserver'\), got"
         r" 'thread'"),
        ({"timeout": 30}, r"`timeout` must be a `datetime.timedelta` \(or None\), got 30"),
        ({"process_group_backend": 1}, r"`process_group_backend` must be a backend name"),
    ],
)
def test_parent_values_that_would_fail_after_launch_are_refused_at_construction(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        TokenMeanDDPStrategy(**kwargs)


@pytest.mark.distributed
@pytest.mark.parametrize("accumulate", [0, -2])
def test_non_positive_accumulation_is_refused_at_fit_start(tmp_path: Path, accumulate: int) -> None:
    errors = raises_everywhere(
        tmp_path, lambda: fit(TokenModule(ragged_batches(2, 2)), strategy_for("lookahead"), tmp_path,
                              accumulate_grad_batches=accumulate)
    )
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("ValueError: `accumulate_grad_batches` must be a positive int"), errors[0]
    assert f"got {accumulate}" in errors[0], errors[0]


class Manual(TokenModule):
    def __init__(self, data: Any) -> None:
        super().__init__(data)
        self.automatic_optimization = False


class WithLBFGS(TokenModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("module_cls", "match"),
    [(Manual, "needs automatic optimization"), (WithLBFGS, "does not support `torch.optim.LBFGS`")],
)
def test_unsupported_setups(tmp_path: Path, module_cls: type[TokenModule], match: str) -> None:
    module = module_cls(ragged_batches(2, 2))
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy_for("lookahead"), tmp_path))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("ValueError: ") and match in errors[0], errors[0]


class ClosureTwice(torch.optim.SGD):
    """A first-order optimizer that evaluates its closure twice in one step (as a line search does)."""

    def step(self, closure: Any = None) -> Any:
        closure()
        return super().step(closure)


class WithClosureTwice(TokenModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return ClosureTwice(self.parameters(), lr=0.1)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_that_evaluates_the_closure_twice_is_refused_on_every_rank(tmp_path: Path, mode: str) -> None:
    """Not LBFGS (refused at fit start) but its pattern: the second evaluation would count the window again. Refused
    at the first step, before the update."""
    module = WithClosureTwice(ragged_batches(2, 2))
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy_for(mode), tmp_path, accumulate_grad_batches=2))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("RuntimeError: token_mean: the optimizer evaluated the closure more than once in one"
                                " step"), errors[0]
    assert not (tmp_path / "params.pt").exists()


class AccumulatingItself(TokenMeanDDPStrategy):
    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


@pytest.mark.distributed
def test_a_strategy_that_handles_accumulation_itself_is_refused_at_fit_start(tmp_path: Path) -> None:
    strategy = AccumulatingItself(**FORK)
    errors = raises_everywhere(tmp_path, lambda: fit(TokenModule(ragged_batches(2, 2)), strategy, tmp_path))
    assert len(set(errors)) == 1, errors
    assert errors[0] == (
        "ValueError: `AccumulatingItself` cannot normalize windows when `handles_gradient_accumulation` is True:"
        " the strategy would no longer see the accumulation windows."
    ), errors[0]


class TupleBatches(TokenModule):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, labels = batch
        return token_loss(self.net, {"x": x, "labels": labels})

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader([(b["x"], b["labels"]) for b in self.data[self.global_rank]], batch_size=None)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_default_count_needs_labels(tmp_path: Path, mode: str) -> None:
    """Without a `labels` key the default count cannot work: every rank says so, naming `count_fn`."""
    module = TupleBatches(ragged_batches(2, 2))
    errors = raises_everywhere(tmp_path, lambda: fit(module, strategy_for(mode), tmp_path))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: ") and "ranks 0, 1: `count_fn` failed" in errors[0], errors[0]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_count_fn_for_tuple_batches(tmp_path: Path, mode: str) -> None:
    data = ragged_batches(2, 4, seed=8)
    strategy = strategy_for(mode, count_fn=lambda batch: (batch[1] != -100).sum())
    params, _ = fit(TupleBatches(data), strategy, tmp_path, accumulate_grad_batches=2)
    expected, _ = reference(data, constant(2))
    assert relative_error(params, expected) < EXACT


# ---------------------------------------------------------------------------------------------------------------
# what users run: Lightning's default subprocess launcher on a real script
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_static_graph_with_accumulation_is_refused_on_every_rank_at_fit_start(tmp_path: Path, mode: str) -> None:
    """DDP's ``static_graph=True`` expects every backward to reduce; accumulation reduces in each window's last one
    only. Refused at fit start, naming the option, where plain DDP fails inside PyTorch (the control below)."""
    run = lambda: fit(TokenModule(ragged_batches(2, 2)), strategy_for(mode, static_graph=True),  # noqa: E731
                      tmp_path, accumulate_grad_batches=2)
    errors = raises_everywhere(tmp_path / "outcomes", run)
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("ValueError: `TokenMeanDDPStrategy` cannot accumulate (accumulate_grad_batches=2)"
                                " with DDP's `static_graph=True`"), errors[0]
    assert "Remove `static_graph=True`" in errors[0], errors[0]


@pytest.mark.distributed
def test_plain_ddp_with_static_graph_and_accumulation_fails_inside_pytorch(tmp_path: Path) -> None:
    """The control: plain DDP with the same options fails, with PyTorch's internal assertion."""
    errors = raises_everywhere(tmp_path / "outcomes", lambda: fit(
        TokenModule(ragged_batches(2, 2)), strategy_for("plain", static_graph=True), tmp_path,
        accumulate_grad_batches=2))
    assert any("expect_autograd_hooks_" in error for error in errors), errors


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_static_graph_without_accumulation_is_exact(tmp_path: Path, mode: str) -> None:
    """K = 1 reduces in every backward, as a static graph expects: accepted, and exact."""
    data = ragged_batches(2, 3, seed=41)
    params, _ = fit(TokenModule(data), strategy_for(mode, static_graph=True), tmp_path, accumulate_grad_batches=1)
    expected, _ = reference(data, constant(1))
    assert relative_error(params, expected) < EXACT


class CompiledModule(TokenModule):
    """A user's `torch.compile`d loss (dynamo's graph capture and AOT autograd; the `aot_eager` backend needs no C
    compiler): the strategy scales the loss the compiled graph returns, and counts the batch outside it."""

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        if not hasattr(self, "compiled"):
            self.compiled = torch.compile(token_loss, backend="aot_eager", dynamic=True)
        loss: Tensor = self.compiled(self.net, batch, self.reduction)
        return loss


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
def test_a_compiled_loss_matches_the_reference(tmp_path: Path, mode: str) -> None:
    data = ragged_batches(2, 5, seed=61)
    data[1][2] = empty_like(data[1][2])
    params, _ = fit(CompiledModule(data), strategy_for(mode), tmp_path, accumulate_grad_batches=2)
    expected, _ = reference(data, constant(2))
    error = relative_error(params, expected)
    if mode == "plain":
        assert error > 1e-6, "plain DDP matched the token mean: the test could not fail"
        return
    assert error < EXACT, f"{mode}: relative parameter error {error:.3e}"
