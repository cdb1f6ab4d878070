"""The objective audit's cost: seconds per optimizer step with ``DenominatorMonitor(audit_every=100)`` against the
same run with the monitor and no audit, side by side in one run.

Both runs train the same model on the same data under ``TokenMeanDDPStrategy`` (lookahead), 2 forked gloo CPU
processes, with a ``DenominatorMonitor`` each; fits alternate off/on, off/on, ... and each repetition gives a ratio
(on / off). A fit is timed from the start of training to the end of its last step, so an audited fit of 100·n
steps holds exactly n audits (the first window and every 100th). It also reports one audited window's time in units
of a plain step (the ``extra`` the audit adds once per ``audit_every`` windows). Workloads: ``tiny`` (the test
suite's TokenNet, where fixed per-step costs dominate) and ``tinylm`` (the example's TinyLM on stdlib-corpus
batches).

    .venv/bin/python benchmarks/audit.py            # ~7 min on 2 cores -> benchmarks/results/audit.{json,md}
    .venv/bin/python benchmarks/audit.py --quick    # < 60 s, audit_every=10 over 20 steps (temp folder)

Target: median ratio ≤ 1.03 at audit_every=100.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (
    add_output_arguments,
    environment,
    environment_markdown,
    markdown_table,
    output_paths,
    quiet_lightning,
    write_results,
)
from _harness import strategy_for, train
from overhead import DEVICES, StepTimer, make_workload
from overhead import Settings as WorkloadSettings

from token_mean import DenominatorMonitor

torch.set_num_threads(1)  # forked workers: see overhead.py


@dataclass
class Settings:
    audit_every: int
    steps: int  # optimizer steps per fit, a multiple of audit_every
    repeats: int  # off/on pairs
    accumulate: int
    lm_batch_size: int


FULL = Settings(audit_every=100, steps=200, repeats=5, accumulate=2, lm_batch_size=1)
QUICK = Settings(audit_every=10, steps=20, repeats=2, accumulate=2, lm_batch_size=1)


def timed_fit(model: str, audited: bool, repeat: int, settings: Settings, tmp: Path) -> dict[str, Any]:
    directory = tmp / f"{model}-{'on' if audited else 'off'}-{repeat}"
    directory.mkdir()
    make = make_workload(model, settings.steps * settings.accumulate,
                         WorkloadSettings(0, settings.steps, 1, settings.lm_batch_size))
    monitor = DenominatorMonitor(audit_every=settings.audit_every if audited else None, on_audit_failure="raise")
    train(make(), strategy_for("lookahead"), DEVICES, callbacks=[StepTimer(directory), monitor],
          accumulate_grad_batches=settings.accumulate, max_steps=settings.steps)
    ranks = [json.loads((directory / f"rank{rank}.json").read_text())["stamps"] for rank in range(DEVICES)]
    stamps = ranks[0]
    steps = [stamps[i + 1][0] - stamps[i][0] for i in range(len(stamps) - 1)]
    if len(steps) != settings.steps:
        raise RuntimeError(f"expected {settings.steps} step ends, got {len(steps)}")
    audited_steps = [i for i in range(0, settings.steps, settings.audit_every)]
    return {"model": model, "audited": audited, "repeat": repeat,
            "seconds_per_step": (stamps[-1][0] - stamps[0][0]) / settings.steps,
            # CPU time of every thread of a rank, mean over ranks: time spent descheduled (other load) left out
            "cpu_seconds_per_step": statistics.mean((r[-1][1] - r[0][1]) / settings.steps for r in ranks),
            "audited_window_s": statistics.mean(steps[i] for i in audited_steps),
            "other_window_s": statistics.median(s for i, s in enumerate(steps) if i not in audited_steps)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for model in dict.fromkeys(r["model"] for r in runs):
        off = {r["repeat"]: r for r in runs if r["model"] == model and not r["audited"]}
        on = [r for r in runs if r["model"] == model and r["audited"]]
        ratios = [r["seconds_per_step"] / off[r["repeat"]]["seconds_per_step"] for r in on]
        cpu_ratios = [r["cpu_seconds_per_step"] / off[r["repeat"]]["cpu_seconds_per_step"] for r in on]
        # an audited window against the median window of the same fit: what one audit costs, in steps
        extra = [(r["audited_window_s"] - r["other_window_s"]) / r["other_window_s"] for r in on]
        rows.append({"model": model, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "ratios": ratios, "cpu_ratio_median": statistics.median(cpu_ratios),
                     "cpu_ratio_min": min(cpu_ratios), "cpu_ratio_max": max(cpu_ratios),
                     "audit_extra_steps_median": statistics.median(extra),
                     "seconds_per_step_off": statistics.median(r["seconds_per_step"] for r in off.values())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "audit")
    args = parser.parse_args()
    json_path, markdown_path = output_paths(args, "audit")
    quiet_lightning()
    settings = QUICK if args.quick else FULL
    env = environment({**asdict(settings), "devices": DEVICES, "backend": "gloo, fork",
                       "strategy": "TokenMeanDDPStrategy(mode='lookahead') + DenominatorMonitor in both runs",
                       "tiny": "tests/_harness.py TokenNet on sft_batches('sft'), float32",
                       "tinylm": "examples/tiny_lm.py TinyLM(LMConfig()) ~0.51M params, AdamW",
                       "quick": args.quick})
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for model in ("tiny", "tinylm"):
            for repeat in range(settings.repeats):
                for audited in (False, True):  # interleaved: drift on a shared machine hits both alike
                    runs.append(timed_fit(model, audited, repeat, settings, Path(tmp_name)))
            print(f"{model} done ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = summarize(runs)
    ratio = {r["model"]: r["ratio_median"] for r in rows}
    cpu = {r["model"]: r["cpu_ratio_median"] for r in rows}
    payload = {"ratio_tinylm": ratio["tinylm"], "ratio_tiny": ratio["tiny"], "cpu_ratio_tinylm": cpu["tinylm"],
               "cpu_ratio_tiny": cpu["tiny"], "target": 1.03, "environment": env,
               "rows": rows, "runs": runs}
    headers = ["model", "s/step without audit", f"wall ratio audit_every={settings.audit_every} (median)", "min–max",
               "CPU ratio (median)", "min–max", "one audited window, extra steps"]
    body = [[r["model"], f"{r['seconds_per_step_off']:.4f}", f"{r['ratio_median']:.3f}",
             f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f}", f"{r['cpu_ratio_median']:.3f}",
             f"{r['cpu_ratio_min']:.3f}–{r['cpu_ratio_max']:.3f}", f"{r['audit_extra_steps_median']:.2f}"]
            for r in rows]
    markdown = "\n\n".join([
        f"### The objective audit: seconds per step with audit_every={settings.audit_every} / without (2 gloo"
        " processes)",
        environment_markdown(env),
        f"{settings.repeats} interleaved off/on pairs; each fit {settings.steps} optimizer steps of K ="
        f" {settings.accumulate}, timed from the start of training (its audits included). Wall ratio: rank 0's wall"
        " time per step, on / off in the same pair; CPU ratio: CPU time per step (mean over ranks), which other load"
        " on a shared machine inflates least. Extra steps = (an audited window's wall time − the fit's median"
        " window) / the median window.",
        markdown_table(headers, body),
    ])
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
