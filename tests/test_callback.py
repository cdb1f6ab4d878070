"""DenominatorMonitor against counts and losses computed directly from the data, with and without the strategy."""

from __future__ import annotations

import doctest
import json
import math
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _harness import EXACT, METHODS, TokenModule, ragged_batches, strategy_for, token_loss, windows_of
from _monitor_helpers import (
    Outcome,
    ValidationModule,
    count_of,
    counts_data,
    exact_trajectory,
    logged,
    trainer_for,
)
from _ranks import raises_everywhere
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

import token_mean.callback
import token_mean.metrics
from token_mean import DenominatorMonitor, DivergenceError
from token_mean._trace import COMPARED_COLUMNS, read_trace
from token_mean.callback import BAR_COUNT, BAR_LOSS
from token_mean.metrics import TokenMeanLoss

# ---------------------------------------------------------------------------------------------------------- counts


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", METHODS)
def test_logged_counts_match_the_data(tmp_path: Path, strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """P=2, K=3, 7 micro-batches per rank: windows of 3, 3 and a partial 1, ranks far apart in valid tokens."""
    if strategy != "plain":
        # The forked workers inherit this: with the strategy the monitor must add no collective of its own.
        def forbidden(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("DenominatorMonitor ran all_gather although the strategy publishes last_window")

        monkeypatch.setattr(torch.distributed, "all_gather", forbidden)
    data = ragged_batches(2, 7, seed=11)
    trainer = trainer_for(tmp_path, strategy_for(strategy), devices=2, accumulate_grad_batches=3,
                          callbacks=[DenominatorMonitor()])
    trainer.fit(TokenModule(data))

    steps = logged(tmp_path)
    windows = windows_of(7, 3)
    assert sorted(steps) == list(range(len(windows)))
    trajectory = exact_trajectory(data, 3)
    for step, window in enumerate(windows):
        rank_counts = [sum(count_of(rank[i]) for i in window) for rank in data]
        total = sum(rank_counts)
        metrics = steps[step]
        assert metrics["global_count"] == total == trajectory[step][0]
        assert metrics["rank_count_min"] == min(rank_counts)
        assert metrics["rank_count_max"] == max(rank_counts)
        assert metrics["rank_count_mean"] == total / 2
        assert metrics["window_length"] == len(window)
        assert metrics["imbalance"] == pytest.approx(max(rank_counts) * 2 / total)
        assert metrics["naive_weight_error"] == pytest.approx(max(abs(2 * n / total - 1) for n in rank_counts))
        assert metrics["naive_weight_error"] > 0.1  # the data is uneven: the test can fail
        assert metrics["items_per_sec"] > 0
        assert ("naive_loss" in metrics) == (strategy == "plain")
    # Step 0 starts from the same parameters everywhere, so its exact loss is known from the data alone.
    assert steps[0]["loss"] == pytest.approx(trajectory[0][1], rel=EXACT)
    if strategy == "plain":
        net = TokenModule(data).net  # the initial parameters
        naive = sum(float(token_loss(net, rank[i]).detach()) / 3 for rank in data for i in windows[0]) / 2
        assert steps[0]["naive_loss"] == pytest.approx(naive, rel=EXACT)
        assert abs(naive - trajectory[0][1]) > 1e-3
        # plain DDP followed another objective, so its next loss is off the token-mean trajectory
        assert steps[1]["loss"] != pytest.approx(trajectory[1][1], rel=1e-6)
    else:
        for step, (_, loss) in enumerate(trajectory):
            assert steps[step]["loss"] == pytest.approx(loss, rel=EXACT)


class BarRecorder(Callback):
    """Each rank writes what the progress bar holds before every batch and at the end of fit."""

    def __init__(self, out: Path) -> None:
        self.out, self.shown = out, []

    def _take(self, trainer: pl.Trainer) -> None:
        self.shown.append({k: v if isinstance(v, int) else float(v) for k, v in trainer.progress_bar_metrics.items()})

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._take(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take(trainer)
        (self.out / f"bar{trainer.global_rank}.json").write_text(json.dumps(self.shown))


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", METHODS)
def test_progress_bar_shows_the_exact_loss_and_n(tmp_path: Path, strategy: str) -> None:
    """docs/monitor.md: `exact_loss` and `N` reach `trainer.progress_bar_metrics` on every rank after each step, and
    no logger (the loggers get `denominator/loss` and `denominator/global_count`)."""
    data = ragged_batches(2, 7, seed=11)
    trainer = trainer_for(tmp_path, strategy_for(strategy), devices=2, accumulate_grad_batches=3,
                          callbacks=[DenominatorMonitor(), BarRecorder(tmp_path)])
    trainer.fit(TokenModule(data))
    trajectory = exact_trajectory(data, 3)
    for rank in (0, 1):
        shown = json.loads((tmp_path / f"bar{rank}.json").read_text())
        steps = [(bar[BAR_COUNT], bar[BAR_LOSS]) for bar in shown if BAR_LOSS in bar]
        distinct = [step for index, step in enumerate(steps) if index == 0 or step != steps[index - 1]]
        assert [n for n, _ in distinct] == [n for n, _ in trajectory], (rank, distinct)
        assert all(isinstance(n, int) for n, _ in distinct), "token counts show as ints, not '13263.000'"
        if strategy != "plain":  # plain DDP leaves the token-mean trajectory after its first step
            assert [loss for _, loss in distinct] == pytest.approx([loss for _, loss in trajectory], rel=EXACT)
        assert distinct[0][1] == pytest.approx(trajectory[0][1], rel=EXACT)
    header = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert BAR_LOSS not in header.split(",") and BAR_COUNT not in header.split(","), header


@pytest.mark.distributed
def test_count_fn_failure_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    def count_fn(batch: dict[str, torch.Tensor]) -> Any:
        return "not a count" if torch.distributed.get_rank() == 1 else (batch["labels"] != -100).sum()

    trainer = trainer_for(tmp_path, strategy_for("plain"), devices=2, accumulate_grad_batches=2,
                          callbacks=[DenominatorMonitor(count_fn=count_fn)])
    errors = raises_everywhere(tmp_path / "outcomes", lambda: trainer.fit(TokenModule(counts_data([[3, 4], [5, 6]]))))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: token_mean: rank 1: `count_fn` failed"), errors[0]
    assert "window of optimizer step 0 (measured by DenominatorMonitor, batches 0..1)." in errors[0], errors[0]


@pytest.mark.distributed
def test_one_step_numbering_in_errors_traces_and_global_step(tmp_path: Path) -> None:
    """docs/monitor.md "Step numbers": the trace numbers the first step 0; a count failing in the second window
    (deferred mode raises in that window) names "optimizer step 1", the row the trace would have written next, and
    the step that runs while `trainer.global_step == 1`."""
    def count_fn(batch: dict[str, torch.Tensor]) -> Any:
        count = (batch["labels"] != -100).sum()
        return "bad" if int(count) == 7 else count  # only rank 1's third batch: the second window

    trainer = trainer_for(tmp_path, strategy_for("deferred", count_fn=count_fn), devices=2, accumulate_grad_batches=2,
                          callbacks=[DenominatorMonitor(record=tmp_path / "trace.csv")])
    data = counts_data([[3, 4, 5, 6], [5, 6, 7, 8]])
    errors = raises_everywhere(tmp_path / "outcomes", lambda: trainer.fit(TokenModule(data)))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("DenominatorError: token_mean: rank 1: `count_fn` failed"), errors[0]
    assert "in the accumulation window of optimizer step 1 (epoch 0, batches 2..3)." in errors[0], errors[0]
    assert sorted(read_trace(tmp_path / "trace.csv")) == [0]


@pytest.mark.distributed
def test_skipped_window_under_the_strategy(tmp_path: Path) -> None:
    """A window with no valid item anywhere: the strategy skips the step; N = 0 is logged, the loss is not."""
    data = counts_data([[3, 0, 4], [2, 0, 5]])
    trace = tmp_path / "trace.jsonl"
    trainer = trainer_for(tmp_path, strategy_for("lookahead"), devices=2,
                          callbacks=[DenominatorMonitor(record=trace)])
    trainer.fit(TokenModule(data))
    steps = logged(tmp_path)
    assert steps[1]["global_count"] == 0.0 and "loss" not in steps[1]
    assert steps[1]["naive_weight_error"] == 0.0 and steps[1]["imbalance"] == 0.0
    rows = read_trace(trace)
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] is None  # no optimizer step, no gradient
    assert rows[1]["param_norm"] == rows[0]["param_norm"]  # parameters unchanged
    assert rows[2]["grad_norm"] is not None


def test_single_device_measures_itself(tmp_path: Path) -> None:
    data = ragged_batches(1, 5, seed=2)
    trainer = trainer_for(tmp_path, accumulate_grad_batches=2, callbacks=[DenominatorMonitor(prefix="tokens")])
    trainer.fit(TokenModule(data))
    with (tmp_path / "logs" / "version_0" / "metrics.csv").open() as file:
        header = file.readline()
    assert "tokens/global_count" in header and "denominator/" not in header
    # one rank: nothing to mis-weight across ranks
    assert trainer.callbacks[0].last_window.naive_weight_error == 0.0  # type: ignore[attr-defined]
    assert trainer.callbacks[0].last_window.window_length == 1  # type: ignore[attr-defined]


class StepCounts(Callback):
    """The N of each optimizer step, as the monitor (a callback before this one) has it after the step's batch."""

    def __init__(self, monitor: DenominatorMonitor) -> None:
        self.monitor, self.counts = monitor, []
        self._last: object = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        window = self.monitor.last_window
        if window is not None and window is not self._last:
            self._last = window
            self.counts.append(window.global_count)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_one_device_in_a_process_with_a_default_group(tmp_path: Path) -> None:
    """Two processes with a gloo default group (launched for other reasons, as by ``torchrun``) each fit their own
    model on one device (``strategy="auto"``: ``SingleDeviceStrategy``) on their own data (5 and 3 micro-batches), the
    monitor measuring (K = 2) and auditing (K = 1) every window: each N is the process's own count, not the sum over
    both, every audit passes, and the monitor issues no collective (a window only one process has would wait)."""
    from _fabric import forked_ranks, launched

    data = counts_data([[3, 5, 2, 7, 1], [11, 4, 9]], seed=3)
    results = launched(forked_ranks(), _alone_on_one_device, data, tmp_path)
    for rank, (counts, passed, collectives) in enumerate(results):
        expected = [[n for n, _ in exact_trajectory([data[rank]], accumulate)] for accumulate in (2, 1)]
        assert counts == expected, f"rank {rank}: N {counts}, its own counts {expected}"
        assert passed == [True] * len(data[rank]), f"rank {rank}: audits {passed}"
        assert collectives == {}, f"rank {rank} issued collectives: {collectives}"


def _alone_on_one_device(fabric: Any, data: list[list[Any]], directory: Path) -> list[Any]:
    from _cost import collectives_issued
    from _fabric import every_rank

    own = [data[fabric.global_rank]]
    (counts, passed), collectives = collectives_issued(directory, _fits, own, directory / str(fabric.global_rank))
    return every_rank((counts, passed, dict(collectives)))


def _fits(own: list[list[Any]], directory: Path) -> tuple[list[list[float]], list[bool]]:
    """A fit measured with K = 2, then one audited with K = 1 (each window its own token mean): their Ns, the audits."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    counts, passed = [], []
    for accumulate, audit_every in ((2, None), (1, 1)):
        monitor = DenominatorMonitor(audit_every=audit_every, on_audit_failure="raise")
        steps = StepCounts(monitor)
        trainer = trainer_for(directory / str(accumulate), accumulate_grad_batches=accumulate, logger=False,
                              callbacks=[monitor, steps])
        assert isinstance(trainer.strategy, SingleDeviceStrategy), trainer.strategy
        trainer.fit(TokenModule(own))
        counts.append(steps.counts)
        passed += [audit.passed for audit in monitor.audits]
    return counts, passed


class MetricSteps(Logger):
    """An in-memory logger: the steps at which the monitor's metrics arrived (one process, so readable after fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if any(name.startswith("denominator/") for name in metrics):
            assert step is not None
            self.steps.append(step)


@pytest.mark.parametrize(
    ("interval", "every_n", "expected"),
    [(2, 1, [1, 3, 5]), (3, 50, [2, 5]), (None, 3, [2, 5]), (None, 1, [0, 1, 2, 3, 4, 5]), (None, 50, [])],
)
def test_logging_interval(tmp_path: Path, interval: int | None, every_n: int, expected: list[int]) -> None:
    """6 optimizer steps (K = 1): `logging_interval` wins over `log_every_n_steps`, which applies without it."""
    data = ragged_batches(1, 6, seed=3)
    monitor = DenominatorMonitor(logging_interval=interval)
    metric_steps = MetricSteps()
    trainer = trainer_for(tmp_path, log_every_n_steps=every_n, callbacks=[monitor], logger=metric_steps)
    trainer.fit(TokenModule(data))
    assert trainer.global_step == 6
    assert metric_steps.steps == expected


# ---------------------------------------------------------------------------------------------------------- traces

# Per rank and step (K=1): steps 0 and 1 even, step 2 uneven, step 3 even again.
COUNTS = [[6, 4, 10, 5], [6, 4, 2, 5]]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_record_then_replay_single_device(tmp_path: Path, suffix: str) -> None:
    data = ragged_batches(1, 6, seed=4)
    trace = tmp_path / f"ref{suffix}"
    trainer_for(tmp_path / "a", accumulate_grad_batches=2, callbacks=[DenominatorMonitor(record=trace)]).fit(
        TokenModule(data)
    )
    rows = read_trace(trace)
    assert list(rows) == [0, 1, 2]
    assert [rows[s]["global_count"] for s in rows] == [c for c, _ in exact_trajectory(data, 2)]
    assert all(set(row) == set(COMPARED_COLUMNS) for row in rows.values())  # only what the comparison needs
    assert all(row["grad_norm"] is not None and row["grad_norm"] > 0 for row in rows.values())

    replay = DenominatorMonitor(reference=trace, on_divergence="raise", rtol=0.0, atol=0.0)
    trainer_for(tmp_path / "b", accumulate_grad_batches=2, callbacks=[replay]).fit(TokenModule(data))
    assert replay.first_divergence is None


@pytest.mark.distributed
def test_plain_ddp_flagged_at_first_uneven_step(tmp_path: Path) -> None:
    """Reference: the token-mean strategy. Plain DDP matches it while ranks are even and diverges at step 2."""
    data = counts_data(COUNTS)
    trace = tmp_path / "ref.csv"
    trainer_for(tmp_path / "ref", strategy_for("lookahead"), devices=2,
                callbacks=[DenominatorMonitor(record=trace)]).fit(TokenModule(data))
    assert [row["global_count"] for row in read_trace(trace).values()] == [12, 8, 12, 10]

    # the same objective (the other mode of the strategy) replays without a divergence
    monitor = DenominatorMonitor(reference=trace, on_divergence="warn")
    trainer_for(tmp_path / "same", strategy_for("deferred"), devices=2,
                callbacks=[monitor, Outcome(tmp_path / "same.json", monitor)]).fit(TokenModule(data))
    assert json.loads((tmp_path / "same.json").read_text()) == {"warnings": [], "divergence": None}

    monitor = DenominatorMonitor(reference=trace, on_divergence="warn")
    trainer_for(tmp_path / "warn", strategy_for("plain"), devices=2,
                callbacks=[monitor, Outcome(tmp_path / "warn.json", monitor)]).fit(TokenModule(data))
    outcome = json.loads((tmp_path / "warn.json").read_text())
    assert outcome["divergence"] == [2, "grad_norm"]
    [message] = outcome["warnings"]  # the first divergent step only
    assert "step 2 diverged" in message and "grad_norm is" in message and "different objective" in message

    trainer = trainer_for(tmp_path / "raise", strategy_for("plain"), devices=2,
                          callbacks=[DenominatorMonitor(reference=trace, on_divergence="raise")])
    errors = raises_everywhere(tmp_path / "raise", lambda: trainer.fit(TokenModule(data)))
    assert len(set(errors)) == 1, errors
    assert re.match(r"DivergenceError: DenominatorMonitor: step 2 diverged .*: grad_norm is", errors[0]), errors[0]


@pytest.mark.distributed
def test_plain_ddp_flagged_against_single_device_reference(tmp_path: Path) -> None:
    """Reference: one device, one micro-batch per step holding both ranks' batches (the unpartitioned token mean)."""
    data = counts_data(COUNTS)
    merged = [[{key: torch.cat([rank[step][key] for rank in data]) for key in data[0][step]} for step in range(4)]]
    trace = tmp_path / "ref.jsonl"
    trainer_for(tmp_path / "ref", callbacks=[DenominatorMonitor(record=trace)]).fit(TokenModule(merged))

    monitor = DenominatorMonitor(reference=trace, on_divergence="log")
    trainer_for(tmp_path / "log", strategy_for("plain"), devices=2,
                callbacks=[monitor, Outcome(tmp_path / "log.json", monitor)]).fit(TokenModule(data))
    assert json.loads((tmp_path / "log.json").read_text()) == {"warnings": [], "divergence": [2, "grad_norm"]}
    steps = logged(tmp_path / "log")
    assert [steps[s]["reference_divergence"] for s in range(4)] == [0.0, 0.0, 1.0, 1.0]
    assert [steps[s]["naive_weight_error"] for s in range(4)] == [0.0, 0.0, pytest.approx(4 / 6), 0.0]


def test_divergent_count_blames_the_data(tmp_path: Path) -> None:
    data = counts_data([[6, 4, 10]])
    trace = tmp_path / "ref.csv"
    trainer_for(tmp_path / "a", callbacks=[DenominatorMonitor(record=trace)]).fit(TokenModule(data))
    other = counts_data([[6, 5, 10]])
    with pytest.raises(DivergenceError, match=r"step 1 .*global_count is 5.0 here but 4.0 .*different data"):
        trainer_for(tmp_path / "b", callbacks=[DenominatorMonitor(reference=trace, on_divergence="raise")]).fit(
            TokenModule(other)
        )


def test_different_number_of_steps(tmp_path: Path) -> None:
    trace = tmp_path / "ref.csv"
    trainer_for(tmp_path / "a", callbacks=[DenominatorMonitor(record=trace)]).fit(TokenModule(counts_data([[3] * 4])))
    with pytest.raises(ValueError, match=r"covers 4 optimizer steps \(0..3\) but this run takes 6 .*different config"):
        trainer_for(tmp_path / "b", callbacks=[DenominatorMonitor(reference=trace)]).fit(
            TokenModule(counts_data([[3] * 6]))
        )


@pytest.mark.parametrize("on_divergence", ["raise", "warn"])
def test_a_stream_longer_than_its_reference(tmp_path: Path, on_divergence: str) -> None:
    """A stream's run length is unknown at fit start, so the steps past the reference are found as they come: the
    first raises, or warns once (and is not compared); the steps before it compare."""
    trace = tmp_path / "ref.csv"
    trainer_for(tmp_path / "a", callbacks=[DenominatorMonitor(record=trace)]).fit(
        TokenModule(counts_data([[3, 4, 5]]), iterable=True)
    )
    monitor = DenominatorMonitor(reference=trace, on_divergence=on_divergence)
    run = lambda: trainer_for(tmp_path / "b", callbacks=[monitor]).fit(  # noqa: E731
        TokenModule(counts_data([[3, 4, 5, 6, 7]]), iterable=True)
    )
    message = rf"Step 3 is not in the reference trace '{re.escape(str(trace))}' \(steps 0..2\): the runs have different"
    if on_divergence == "raise":
        with pytest.raises(DivergenceError, match=message):
            run()
        return
    with pytest.warns(UserWarning, match=message + r"[\s\S]*Such steps are not compared") as warned:
        run()
    assert sum("is not in the reference trace" in str(w.message) for w in warned) == 1
    assert monitor.first_divergence is None


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


HEADER = "step,global_count,loss,grad_norm,param_norm\n"


@pytest.mark.parametrize(
    ("name", "text", "error", "match"),
    [
        ("t.csv", "step,global_count,loss\n0,4,1.0\n", ValueError,
         r"lacks the columns \['grad_norm', 'param_norm'\]"),
        ("t.jsonl", '{"step": 0, "global_count": 4}\n', ValueError, r"line 1 lacks the columns \['loss'"),
        ("t.jsonl", "[0, 4]\n", ValueError, r"line 1: expected one JSON object per line, got list"),
        ("t.jsonl", '{"step": 0,\n', ValueError, r"line 1: not JSON"),
        ("t.csv", HEADER + "0,4,abc,1,1\n", ValueError, r"line 2: column 'loss' holds 'abc', not a number"),
        ("t.csv", HEADER + "0.5,4,1,1,1\n", ValueError, r"`step` must be a non-negative integer, got '0.5'"),
        ("t.csv", HEADER + "1,4,1,1,1\n0,4,1,1,1\n", ValueError, r"step 0 follows step 1; steps must increase"),
        ("t.csv", HEADER + "0,4,1,1\n", ValueError, r"line 2: the row does not have the 5 fields"),
        ("t.csv", HEADER + "0,,1,1,1\n", ValueError, r"`global_count` is empty"),
        ("t.csv", HEADER, ValueError, r"holds no step"),
        ("t.jsonl", "", ValueError, r"holds no step"),
    ],
)
def test_malformed_trace(tmp_path: Path, name: str, text: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        read_trace(write(tmp_path / name, text))


def test_malformed_trace_fails_at_fit_start(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.csv", "step,loss\n0,1\n")
    trainer = trainer_for(tmp_path, callbacks=[DenominatorMonitor(reference=trace)])
    with pytest.raises(ValueError, match=r"lacks the columns \['global_count'"):
        trainer.fit(TokenModule(counts_data([[3] * 2])))
    with pytest.raises(FileNotFoundError, match=r"does not exist\. Record one first"):
        trainer_for(tmp_path, callbacks=[DenominatorMonitor(reference=tmp_path / "missing.jsonl")]).fit(
            TokenModule(counts_data([[3] * 2]))
        )


def test_trace_round_trips_none_and_nonfinite(tmp_path: Path) -> None:
    from token_mean._trace import TraceWriter

    for suffix in (".csv", ".jsonl"):
        writer = TraceWriter(tmp_path / f"t{suffix}")
        writer.write({"step": 0, "global_count": 0.0, "loss": None, "grad_norm": 0.1 + 0.2, "param_norm": math.inf})
        writer.close()
        row = read_trace(tmp_path / f"t{suffix}")[0]
        assert row["loss"] is None
        assert row["grad_norm"] == 0.1 + 0.2 and row["param_norm"] == math.inf


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"record": "trace.pkl"}, ValueError, r"`record='trace.pkl'` has the suffix '.pkl'.*never pickled"),
        ({"reference": "trace"}, ValueError, r"`reference='trace'` has the suffix ''"),
        ({"record": "t.csv", "reference": "t.csv"}, ValueError, r"are the same file, 't.csv'"),
        ({"rtol": -1.0}, ValueError, r"`rtol` must be a number >= 0, got -1.0"),
        ({"atol": "0"}, ValueError, r"`atol` must be a number >= 0, got '0'"),
        ({"on_divergence": "ignore"}, ValueError, r"'warn', 'raise' or 'log', got 'ignore'"),
        ({"logging_interval": 0}, ValueError, r"positive int .* got 0"),
        ({"loss_reduction": "avg"}, ValueError, r"`loss_reduction` must be 'mean' .* or 'sum' .*, got 'avg'"),
        ({"count_fn": 3}, TypeError, r"`count_fn` must be a callable .* got int: 3"),
        ({"prefix": None}, TypeError, r"`prefix` must be a str"),
    ],
)
@pytest.mark.parametrize("monitor", ["DenominatorMonitor", "FabricMonitor"])
def test_bad_settings(kwargs: dict[str, Any], error: type[Exception], match: str, monitor: str) -> None:
    """Both monitors take the same settings and check them alike: `FabricMonitor(loss_reduction="avg")` once
    audited a sum without a word."""
    from token_mean.fabric_monitor import FabricMonitor

    with pytest.raises(error, match=match):
        {"DenominatorMonitor": DenominatorMonitor, "FabricMonitor": FabricMonitor}[monitor](**kwargs)


def test_count_fn_is_used_without_strategy(tmp_path: Path) -> None:
    data = counts_data([[3, 5]])
    monitor = DenominatorMonitor(count_fn=lambda batch: len(batch["labels"]))  # examples, not tokens
    trainer_for(tmp_path, callbacks=[monitor]).fit(TokenModule(data))
    assert [row["global_count"] for row in logged(tmp_path).values()] == [2.0, 2.0]


# ---------------------------------------------------------------------------------------------------------- validation


@pytest.mark.distributed
def test_token_mean_validation_loss(tmp_path: Path) -> None:
    data = counts_data([[12, 2, 7, 5], [1, 3, 12, 9]])  # no empty batch: Lightning's mean of means would be NaN
    module = ValidationModule(data)
    [results] = trainer_for(tmp_path, strategy_for("plain"), devices=2, logger=False).validate(module)
    expected_sum = sum(float(token_loss(module.net, b, "sum").detach()) for rank in data for b in rank)
    expected = expected_sum / sum(count_of(b) for rank in data for b in rank)
    assert results["val_token_mean"] == pytest.approx(expected, rel=1e-12)
    assert abs(results["val_sync_dist"] - expected) > 1e-3 * expected  # Lightning's default is a mean of means


def test_token_mean_loss_unit() -> None:
    metric = TokenMeanLoss()
    metric.update(torch.tensor([2.0, float("nan")]), torch.tensor([3, 0]))
    metric.update(torch.tensor(6.0), 1)
    assert metric.compute().item() == 3.0
    summed = TokenMeanLoss(loss_reduction="sum")
    summed.update(torch.tensor(6.0), 3)
    summed.update(torch.tensor(0.0), 0)
    assert summed.compute().item() == 2.0
    with pytest.raises(ValueError, match=r"needs the count of valid items"):
        metric.update(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"one count per loss, got losses of shape \(2,\) and counts of shape \(\)"):
        metric.update(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match=r"`loss_reduction` must be 'mean' .* got 'avg'"):
        TokenMeanLoss(loss_reduction="avg")  # type: ignore[arg-type]


def test_docstring_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for module in (token_mean.callback, token_mean.metrics):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_validation_data_unused_by_monitor(tmp_path: Path) -> None:
    """Validation batches inside the fit loop are not counted as training micro-batches."""
    data = counts_data([[4, 4, 4, 4]])
    module = ValidationModule(data)
    trainer_for(tmp_path, accumulate_grad_batches=2, val_check_interval=1, callbacks=[DenominatorMonitor()]).fit(module)
    assert [row["global_count"] for row in logged(tmp_path).values()] == [8.0, 8.0]
