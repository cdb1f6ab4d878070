"""The cost at scale, on paper: an α-β model of the strategy's extra collectives against the gradient all-reduce.

Per optimizer step (one accumulation window), plain DDP all-reduces the gradient once. The strategy adds small,
latency-bound collectives of a 10-value float64 record per rank (80 bytes):

- lookahead: two all_gathers, one before the window's first backward (the counts) and one at its last micro-batch
  (the loss sum and problem flags);
- deferred: one all_gather at the window's last micro-batch; the count is applied inside DDP's own gradient buckets
  by a comm hook, so there is no extra pass over the gradients;
- the alternative for huge P: one all_reduce (SUM) of [N, loss sum, flags] through a tree, per-rank counts dropped.

Models (α: latency per hop, β: bandwidth per rank, S: gradient bytes, m: record bytes per rank):

    ring all_gather          (P−1)·α + (P−1)·m/β
    tree all_reduce          2·log2(P)·α + 2·log2(P)·M/β     (M = the whole 80-byte record)
    ring gradient all-reduce 2(P−1)·α + 2(P−1)/P · S/β

No torch needed; `--overhead-json` adds the gloo latency measured by overhead.py as a calibration line.

    python benchmarks/scale_model.py
    python benchmarks/scale_model.py --overhead-json benchmarks/results/overhead.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# Assumptions (sources in benchmarks/README.md):
ALPHA_NCCL = 5e-6  # s per hop across nodes: InfiniBand NDR 2–5 µs per switch hop plus NCCL's per-step overhead
ALPHA_NCCL_PESSIMISTIC = 20e-6  # s: a loaded fabric / Simple protocol / extra software layers
BETA_NCCL = 50e9  # bytes/s per GPU across nodes: one 400 Gb/s NDR NIC per GPU (DGX H100 reference design)
RECORD_BYTES = 10 * 8  # the strategy's per-rank float64 record
BF16_BYTES = 2
MODELS = {"1B": 1e9, "70B": 70e9}
WORLD_SIZES = [8 * 2**i for i in range(12)]  # 8 .. 16,384
THRESHOLD = 0.01  # "matters" = more than 1% of the gradient all-reduce


def ring_all_gather(p: int, alpha: float, beta: float, m: float = RECORD_BYTES) -> float:
    return (p - 1) * alpha + (p - 1) * m / beta


def tree_all_reduce(p: int, alpha: float, beta: float, m: float = RECORD_BYTES) -> float:
    hops = 2 * math.log2(p)
    return hops * alpha + hops * m / beta


def ring_all_reduce(p: int, alpha: float, beta: float, size: float) -> float:
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * size / beta


def bandwidth_floor(p: int, beta: float, size: float) -> float:
    """The gradient all-reduce with its latency ignored: the smallest denominator, so the harshest comparison."""
    return 2 * (p - 1) / p * size / beta


def extras(p: int, alpha: float, beta: float) -> dict[str, float]:
    return {
        "lookahead (2 ring all_gathers)": 2 * ring_all_gather(p, alpha, beta),
        "deferred (1 ring all_gather)": ring_all_gather(p, alpha, beta),
        "fused all_reduce (1 tree)": tree_all_reduce(p, alpha, beta),
    }


def first_world_size(alpha: float, beta: float, size: float, which: str, floor: bool) -> int | None:
    """The smallest P (power of two from 8) at which the extra collective exceeds THRESHOLD of the gradient's."""
    p = 8
    while p <= 2**24:
        gradient = bandwidth_floor(p, beta, size) if floor else ring_all_reduce(p, alpha, beta, size)
        if extras(p, alpha, beta)[which] > THRESHOLD * gradient:
            return p
        p *= 2
    return None


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def table(alpha: float, beta: float) -> str:
    lines = [
        "| P | grad all-reduce 1B | grad all-reduce 70B | lookahead extra | deferred extra | fused tree all_reduce"
        " | lookahead / grad 1B | lookahead / grad 70B | tree / grad 1B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in WORLD_SIZES:
        grads = {name: ring_all_reduce(p, alpha, beta, params * BF16_BYTES) for name, params in MODELS.items()}
        extra = extras(p, alpha, beta)
        look, deferred, tree = extra.values()
        lines.append(
            f"| {p:,} | {fmt_seconds(grads['1B'])} | {fmt_seconds(grads['70B'])} | {fmt_seconds(look)}"
            f" | {fmt_seconds(deferred)} | {fmt_seconds(tree)} | {look / grads['1B']:.2%} | {look / grads['70B']:.3%}"
            f" | {tree / grads['1B']:.3%} |"
        )
    return "\n".join(lines)


def thresholds(alpha: float, beta: float) -> str:
    lines = [
        f"| extra collective | model | P where it exceeds {THRESHOLD:.0%} of the ring gradient all-reduce |"
        " … of its bandwidth term alone |",
        "|---|---|---|---|",
    ]
    for which in extras(8, alpha, beta):
        for name, params in MODELS.items():
            size = params * BF16_BYTES
            ring = first_world_size(alpha, beta, size, which, floor=False)
            floor = first_world_size(alpha, beta, size, which, floor=True)
            lines.append(
                f"| {which} | {name} | {f'{ring:,}' if ring else '> 16.7M'} | {f'{floor:,}' if floor else '> 16.7M'} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overhead-json", type=Path, help="overhead.py's JSON, for the measured gloo latency")
    args = parser.parse_args()
    for label, alpha in (("α = 5 µs", ALPHA_NCCL), ("α = 20 µs (pessimistic)", ALPHA_NCCL_PESSIMISTIC)):
        print(f"#### {label}, β = {BETA_NCCL / 1e9:.0f} GB/s per GPU, bf16 gradients, 80-byte record per rank\n")
        print(table(alpha, BETA_NCCL))
        print()
        print(thresholds(alpha, BETA_NCCL))
        print()
    if args.overhead_json is not None:
        measured = json.loads(args.overhead_json.read_text())["collectives_gloo_2proc"]
        alpha_gloo = measured["all_gather_record_us"] * 1e-6  # P = 2: one ring step, so the call time is α
        print(
            f"Calibration (this machine, gloo, P = 2): one all_gather of the record takes {alpha_gloo * 1e6:.0f} µs,"
            f" so α_gloo ≈ {alpha_gloo * 1e6:.0f} µs, {alpha_gloo / ALPHA_NCCL:.0f}× the NCCL α above;"
            f" lookahead adds ≈ {2 * alpha_gloo * 1e3:.2f} ms and deferred ≈ {alpha_gloo * 1e3:.2f} ms per"
            " optimizer step here."
        )


if __name__ == "__main__":
    main()
