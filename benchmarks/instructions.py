"""Host work per optimizer step as CPU instructions (callgrind): the host-time benchmark's fits, counted exactly.

``host_time.py`` times the same fits in lockstep pairs against plain DDP, to about ±2 %; on a shared VM a whole fit's
time per step swings by ±20–50 % between neighbouring fits, so two versions of the package run one after the other
cannot be told apart by time alone. An instruction count moves far less: two runs of the same code agree to about
0.1–0.4 % of a fit's count (the hash seed and the address layout fixed, the warm-up's objects frozen), load or no
load. It is not time: cold code (a
window's work runs once per step, between Lightning's) retires fewer instructions per cycle than Lightning's loop,
so the time ratio exceeds the instruction ratio; read both.

Each fit of ``host_time.run_fit`` (one process, world size 1, gloo, the same model, data and warm-up) runs in a child
process under ``valgrind --tool=callgrind --instr-atstart=no``, which starts collecting at the end of the warm-up
step and stops at the end of the last one (``callgrind_control -i on|off`` on its own pid, from the timing
callback). The parent-side cost of those two control calls is the same in every fit, so each cell runs two fits,
of n₁ and n₂ timed steps, and instructions per step = (I₂ − I₁) / (n₂ − n₁): the control calls cancel exactly.
Children run with ``PYTHONHASHSEED=0`` and without address randomization (``setarch -R``), and at the end of the
warm-up collect and ``gc.freeze()`` what they hold (Lightning's, torch's and the data's objects): a full collection
scans all of it, millions of instructions, and whether one falls inside the counted steps moved a fit's count by
~1 %; after the freeze, collections scan only what the steps make, as in a long run. Cells run two children at a time
(2 cores).

    .venv/bin/python benchmarks/instructions.py            # ~6 min on 2 cores -> benchmarks/results/instructions.*
    .venv/bin/python benchmarks/instructions.py --quick    # K = 1 only, 2 and 4 timed steps (temp folder)

Needs ``valgrind`` (with ``callgrind_control``) on the PATH; without it the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"

from _common import (
    add_output_arguments,
    environment,
    environment_markdown,
    markdown_table,
    output_paths,
    write_results,
)

ACCUMULATIONS = (1, 4)
METHODS = ("plain", "lookahead", "deferred", "floor", "floor_record")  # the floors: host_time.py's
WARMUP_STEPS = 20  # as host_time.py
FULL_STEPS = (30, 90)  # n₁, n₂ timed steps
QUICK_STEPS = (2, 4)
COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")
# one process's count moves with its string hashes and addresses (dict and set layouts, the allocator): children run
# with PYTHONHASHSEED=0 and, where setarch can turn it off, no address randomization (two fits of the same code then
# differ by ~0.1 %; with both random, by ~0.3 %, which the difference of two fits amplifies)
FIXED_LAYOUT = ["setarch", platform.machine(), "-R"] if shutil.which("setarch") else []


def collected(log: str) -> int:
    """The instruction count (Ir) callgrind reports at exit ("Collected : N")."""
    found = COLLECTED.findall(log)
    if not found:
        raise RuntimeError(f"no callgrind count in the child's output:\n{log[-2000:]}")
    return int(found[-1])


def per_step(first: int, second: int, first_steps: int, second_steps: int) -> float:
    """Instructions per step from two fits of ``first_steps`` and ``second_steps`` timed steps (what every fit costs
    besides its steps, the control calls among it, cancels)."""
    if second_steps <= first_steps:
        raise ValueError(f"the second fit must time more steps than the first, got {first_steps} and {second_steps}")
    return (second - first) / (second_steps - first_steps)


def count(method: str, accumulate: int, timed_steps: int) -> int:
    """One fit under callgrind, collecting over its ``timed_steps`` steps after the warm-up."""
    with tempfile.TemporaryDirectory(prefix="token_mean-callgrind-") as folder:
        command = [*FIXED_LAYOUT, "valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={Path(folder) / 'callgrind.out'}",
                   sys.executable, __file__, "--child", method, str(accumulate), str(timed_steps)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False,
                              start_new_session=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"{method} K={accumulate}: the callgrind child exited {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    return collected(done.stderr)


def child(method: str, accumulate: int, timed_steps: int) -> None:
    """The fit inside valgrind: collect from the end of the warm-up step to the end of the last."""
    import host_time

    steps = WARMUP_STEPS + timed_steps
    settings = host_time.Settings(steps=steps, warmup_steps=WARMUP_STEPS, repetitions=1, profile_repetitions=1)
    pid = str(os.getpid())

    def at_step(step: int) -> None:
        if step == WARMUP_STEPS:  # what the process holds by now is never scanned again (module docstring)
            gc.collect()
            gc.freeze()
        if step in (WARMUP_STEPS, steps):
            switch = "on" if step == WARMUP_STEPS else "off"
            subprocess.run(["callgrind_control", "-i", switch, pid], check=True, capture_output=True, timeout=300)

    host_time.quiet_lightning()
    host_time.run_fit(method, accumulate, host_time.make_data(steps, accumulate), settings, at_step)


def measure(accumulations: tuple[int, ...], steps: tuple[int, int]) -> list[dict[str, Any]]:
    cells = [(method, accumulate) for accumulate in accumulations for method in METHODS]
    jobs = [(method, accumulate, n) for method, accumulate in cells for n in steps]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(*job), jobs), strict=True))
    rows = []
    for method, accumulate in cells:
        first, second = (counts[(method, accumulate, n)] for n in steps)
        rows.append({"method": method, "accumulate": accumulate, "instructions": [first, second],
                     "timed_steps": list(steps), "per_step": per_step(first, second, *steps)})
    for row in rows:
        plain = next(r for r in rows if r["method"] == "plain" and r["accumulate"] == row["accumulate"])
        row["ratio"] = row["per_step"] / plain["per_step"]
        row["extra_per_window"] = row["per_step"] - plain["per_step"]
    return rows


def report(env: dict[str, Any], rows: list[dict[str, Any]], steps: tuple[int, int]) -> str:
    headers = ["K", "method", "instructions / step", "ratio vs plain", "extra per window", "extra per micro-batch"]
    table = [[row["accumulate"], row["method"], f"{row['per_step']:,.0f}",
              "1" if row["method"] == "plain" else f"**{row['ratio']:.3f}**",
              "" if row["method"] == "plain" else f"+{row['extra_per_window']:,.0f}",
              "" if row["method"] == "plain" else f"+{row['extra_per_window'] / row['accumulate']:,.0f}"]
             for row in rows]
    return "\n\n".join([
        "### Host work: CPU instructions per optimizer step against plain DDPStrategy (callgrind; one process,"
        " world size 1, gloo)",
        environment_markdown(env),
        f"host_time.py's fits under valgrind's callgrind, collecting from the end of the {WARMUP_STEPS}th (warm-up)"
        f" step to the end of the last; per cell two fits of {steps[0]} and {steps[1]} timed steps, instructions per"
        " step = the difference / the difference in steps (PYTHONHASHSEED=0, no address randomization, the warm-up's"
        " objects frozen: two fits of the same code agree to about 0.1–0.4 %). Instructions are not time: compare"
        " host_time.md's ratios.",
        markdown_table(headers, table),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "instructions")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "K", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"instructions.py needs {' and '.join(missing)} on the PATH (apt install valgrind)", file=sys.stderr)
        sys.exit(2)
    json_path, markdown_path = output_paths(args, "instructions")
    steps = QUICK_STEPS if args.quick else FULL_STEPS
    accumulations = (1,) if args.quick else ACCUMULATIONS
    env = environment({
        "accumulations": list(accumulations), "methods": list(METHODS), "warmup_steps": WARMUP_STEPS,
        "timed_steps": list(steps), "tool": subprocess.run(["valgrind", "--version"], capture_output=True,
                                                             text=True, check=False).stdout.strip(),
        "fits": "host_time.run_fit (one process, world size 1, gloo), each in its own valgrind child,"
                " PYTHONHASHSEED=0" + (", setarch -R" if FIXED_LAYOUT else ", address randomization on"),
        "quick": args.quick,
    })
    started = time.perf_counter()
    rows = measure(accumulations, steps)
    payload = {**{f"ratio_{r['method']}_K{r['accumulate']}": r["ratio"] for r in rows if r["method"] != "plain"},
               "environment": env, "rows": rows}
    markdown = report(env, rows, steps)
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
