"""The count check's cost at fit start: the first window's wall time with the check and without, side by side in one
run, in units of a steady window (what the check adds once per fit).

Both runs train the same model on the same data under ``TokenMeanDDPStrategy`` (lookahead), 2 forked gloo CPU
processes, ``check_count=True`` against ``check_count=False``, fits alternating off/on. The check replays every
real micro-batch of the first window three times without gradient (tests/test_count_check.py counts the forwards
and the one ``all_gather_object``); per audited window the audit runs the same check, which
``benchmarks/audit.py`` measures as part of an audited window. Workloads as there: ``tiny`` (the suite's
TokenNet) and ``tinylm`` (the example's TinyLM on stdlib-corpus batches).

    .venv/bin/python benchmarks/count_check.py            # ~2 min on 2 cores -> benchmarks/results/count_check.*
    .venv/bin/python benchmarks/count_check.py --quick    # < 40 s (temp folder)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import torch
from _harness import strategy_for, train
from overhead import DEVICES, StepTimer, make_workload
from overhead import Settings as WorkloadSettings

torch.set_num_threads(1)  # forked workers: see overhead.py

ACCUMULATE, STEPS = 2, 20


def timed_fit(model: str, checked: bool, repeat: int, tmp: Path) -> dict[str, Any]:
    directory = tmp / f"{model}-{checked}-{repeat}"
    directory.mkdir()
    make = make_workload(model, STEPS * ACCUMULATE, WorkloadSettings(0, STEPS, 1, 1))
    train(make(), strategy_for("lookahead", check_count=checked), DEVICES, callbacks=[StepTimer(directory)],
          accumulate_grad_batches=ACCUMULATE, max_steps=STEPS)
    stamps = json.loads((directory / "rank0.json").read_text())["stamps"]
    windows = [stamps[i + 1][0] - stamps[i][0] for i in range(len(stamps) - 1)]
    return {"model": model, "checked": checked, "repeat": repeat, "first_window_s": windows[0],
            "steady_window_s": statistics.median(windows[2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_output_arguments(parser, "count_check")
    args = parser.parse_args()
    json_path, markdown_path = _common.output_paths(args, "count_check")
    _common.quiet_lightning()
    repeats = 2 if args.quick else 5
    env = _common.environment({"devices": DEVICES, "backend": "gloo, fork", "accumulate": ACCUMULATE, "steps": STEPS,
                       "repeats": repeats, "strategy": "TokenMeanDDPStrategy(mode='lookahead'), check_count on/off",
                       "tiny": "tests/_harness.py TokenNet on sft_batches('sft'), float32",
                       "tinylm": "examples/tiny_lm.py TinyLM(LMConfig()) ~0.51M params", "quick": args.quick})
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for model in ("tiny", "tinylm"):
            for repeat in range(repeats):
                for checked in (False, True):  # interleaved: drift on a shared machine hits both alike
                    runs.append(timed_fit(model, checked, repeat, Path(tmp_name)))
    rows = []
    for model in ("tiny", "tinylm"):
        off = {r["repeat"]: r for r in runs if r["model"] == model and not r["checked"]}
        on = [r for r in runs if r["model"] == model and r["checked"]]
        extra = [(r["first_window_s"] - off[r["repeat"]]["first_window_s"]) / off[r["repeat"]]["steady_window_s"]
                 for r in on]
        seconds = [r["first_window_s"] - off[r["repeat"]]["first_window_s"] for r in on]
        rows.append({"model": model, "extra_steps_median": statistics.median(extra), "extra_steps": extra,
                     "extra_seconds_median": statistics.median(seconds),
                     "steady_window_s": statistics.median(r["steady_window_s"] for r in off.values())})
    payload = {"environment": env, "rows": rows, "runs": runs}
    headers = ["model", "steady window (s)", "the check at fit start (s, median)", "in steady windows (median)",
               "min–max"]
    body = [[r["model"], f"{r['steady_window_s']:.4f}", f"{r['extra_seconds_median']:.4f}",
             f"{r['extra_steps_median']:.2f}", f"{min(r['extra_steps']):.2f}–{max(r['extra_steps']):.2f}"]
            for r in rows]
    markdown = "\n\n".join([
        "### The count check at fit start: the first window with the check / without (2 gloo processes)",
        _common.environment_markdown(env),
        f"{repeats} interleaved off/on pairs of {STEPS}-step fits, K = {ACCUMULATE}. The check's cost is the first"
        " window's wall time on rank 0 with the check minus without, in seconds and in units of the fit's median"
        " steady window (windows 2 on). It is paid once per fit: three forwards without gradient per micro-batch of"
        " the first window, and one `all_gather_object`.",
        _common.markdown_table(headers, body),
    ])
    _common.write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
