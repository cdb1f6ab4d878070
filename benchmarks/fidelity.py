"""Fidelity: how far each method's parameters land from the unpartitioned token-mean reference.

For every world size P, accumulation K, raggedness level and dtype, the same data is trained for a fixed number of
SGD-with-momentum steps by plain ``DDPStrategy``, ``TokenMeanDDPStrategy(mode="lookahead")`` and
``TokenMeanDDPStrategy(mode="deferred")`` (P forked gloo CPU processes), and compared with a plain-torch run that
takes, for each optimizer step, the mean loss over every valid token of all ranks and micro-batches, in float64.
The error is the largest per-tensor ‖p − p_ref‖ / ‖p_ref‖. Target: lookahead and deferred ≤ 1e-12 in float64.

The model, data, loss and reference are the test suite's own (``tests/_harness.py``: ``TokenNet``,
``sft_batches``, ``reference``).

    .venv/bin/python benchmarks/fidelity.py                  # full grid, 216 fits, a few minutes on 2 cores
    .venv/bin/python benchmarks/fidelity.py --quick          # P=2, K=4 only (< 30 s), into a temporary folder
    .venv/bin/python benchmarks/fidelity.py --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import tempfile
import time
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
from _harness import (
    METHODS,
    RAGGEDNESS,
    TokenModule,
    cast,
    constant,
    fit,
    reference,
    relative_error,
    sft_batches,
    strategy_for,
)

# Workers are forked from this process, and a forked child deadlocks in its first parallel op if the parent's
# OpenMP pool has run: one intra-op thread, set before any torch op. The tensors here are tiny anyway.
torch.set_num_threads(1)

WORLD_SIZES = (1, 2, 4)  # 4 gloo processes on 2 cores is slow but fine
ACCUMULATIONS = (1, 2, 4, 8)
DTYPES = {"float64": torch.float64, "float32": torch.float32}
STEPS = 4  # optimizer steps per fit; every window is full (STEPS·K micro-batches per rank)
LR, MOMENTUM = 0.2, 0.9  # large enough that a mis-weighted gradient moves the parameters visibly
EXACT = 1e-12  # the float64 target for lookahead and deferred
QUICK = {"world_sizes": (2,), "accumulations": (4,)}

Cell = dict[str, Any]


def run_cell(devices: int, accumulate: int, raggedness: str, dtype: str, workdir: Path) -> list[Cell]:
    """Train every method on one grid cell and measure its error against the float64 reference."""
    data = sft_batches(raggedness, devices, STEPS * accumulate, seed=devices * 100 + accumulate)
    expected, _ = reference(data, constant(accumulate), lr=LR, momentum=MOMENTUM)
    counts = [int((b["labels"] != -100).sum()) for rank in data for b in rank]
    cells: list[Cell] = []
    for method in METHODS:
        path = workdir / f"P{devices}-K{accumulate}-{raggedness}-{dtype}-{method}"
        module = TokenModule(cast(data, DTYPES[dtype]), dtype=DTYPES[dtype], lr=LR, momentum=MOMENTUM)
        started = time.perf_counter()
        params, _ = fit(module, strategy_for(method), path, devices, accumulate_grad_batches=accumulate)
        cells.append({
            "world_size": devices, "accumulate": accumulate, "raggedness": raggedness, "dtype": dtype,
            "method": method, "relative_error": relative_error(params, expected),
            "micro_batch_counts_min_max": [min(counts), max(counts)], "seconds": time.perf_counter() - started,
        })
    return cells


def summary_rows(cells: list[Cell]) -> list[list[str]]:
    """One row per (P, K, raggedness): the three methods' errors in float64, then in float32."""
    rows: dict[tuple[int, int, str], dict[str, float]] = {}
    for cell in cells:
        key = (cell["world_size"], cell["accumulate"], cell["raggedness"])
        rows.setdefault(key, {})[f"{cell['method']}/{cell['dtype']}"] = cell["relative_error"]
    table = []
    for (devices, accumulate, raggedness), errors in rows.items():
        row = [str(devices), str(accumulate), raggedness]
        row += [f"{errors[f'{m}/{d}']:.1e}" if f"{m}/{d}" in errors else "" for d in DTYPES for m in METHODS]
        table.append(row)
    return table


def verdict(cells: list[Cell]) -> tuple[bool, str]:
    exact = [c for c in cells if c["method"] != "plain" and c["dtype"] == "float64"]
    worst = max(exact, key=lambda c: c["relative_error"])
    ok = worst["relative_error"] <= EXACT
    plain = [c for c in cells if c["method"] == "plain" and c["dtype"] == "float64" and c["raggedness"] != "uniform"
             and c["world_size"] * c["accumulate"] > 1]  # with one micro-batch per step, a mean is the token mean
    plain_part = ""
    if plain:
        plain_part = (
            f"; plain DDP on ragged cells with P·K > 1: {min(c['relative_error'] for c in plain):.1e}"
            f" .. {max(c['relative_error'] for c in plain):.1e}"
        )
    return ok, (
        f"{'PASS' if ok else 'FAIL'}: worst float64 error of lookahead/deferred {worst['relative_error']:.1e}"
        f" (P={worst['world_size']}, K={worst['accumulate']}, {worst['raggedness']}, {worst['method']}),"
        f" target ≤ {EXACT:.0e}{plain_part}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "fidelity")  # --quick: P=2, K=4 only, every raggedness, method and dtype
    args = parser.parse_args()
    json_path, markdown_path = output_paths(args, "fidelity")
    quiet_lightning()
    world_sizes = QUICK["world_sizes"] if args.quick else WORLD_SIZES
    accumulations = QUICK["accumulations"] if args.quick else ACCUMULATIONS
    configuration = {
        "world_sizes": list(world_sizes), "accumulations": list(accumulations), "raggedness": list(RAGGEDNESS),
        "methods": list(METHODS), "dtypes": list(DTYPES), "steps": STEPS, "optimizer": f"SGD(lr={LR},"
        f" momentum={MOMENTUM})", "model": "tests/_harness.py TokenNet: Linear(5,6)-tanh-Linear(6,7), token-level"
        " cross-entropy", "data": "tests/_harness.py sft_batches",
        "rows_per_micro_batch": 4, "reference": "plain torch, unpartitioned, float64", "backend": "gloo, fork",
        "quick": args.quick,
    }
    env = environment(configuration)
    cells: list[Cell] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for devices in world_sizes:
            for accumulate in accumulations:
                for raggedness in RAGGEDNESS:
                    for dtype in DTYPES:
                        cells += run_cell(devices, accumulate, raggedness, dtype, Path(tmp))
                print(f"P={devices} K={accumulate} done ({time.perf_counter() - started:.0f} s)", flush=True)
    ok, line = verdict(cells)
    headers = ["P", "K", "raggedness", *(f"{m} {d}" for d in DTYPES for m in METHODS)]
    markdown = "\n\n".join([
        "### Fidelity: relative parameter error against the unpartitioned float64 reference",
        environment_markdown(env),
        f"{STEPS} steps of SGD(lr={LR}, momentum={MOMENTUM}); error = max over tensors of ‖p − p_ref‖ / ‖p_ref‖.",
        markdown_table(headers, summary_rows(cells)),
        line,
    ])
    write_results(json_path, markdown_path, {"environment": env, "target": EXACT, "pass": ok, "cells": cells}, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
