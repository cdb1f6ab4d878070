"""The cost at scale: exposed time of the strategy's per-window exchange against the step time, old design vs new.

Per optimizer step (one accumulation window) plain DDP all-reduces the gradient in 25 MiB buckets, overlapped with
the last backward. The strategy adds a small exchange per window:

- **old design** (before core v2): two blocking ``all_gather``s of a 10-float64 record per rank (counts, then loss and
  flags), each followed by O(P) host work on the P gathered rows. Blocking: both are fully exposed.
- **new design**: one ``all_reduce`` (SUM) of a fixed-size float64 record (``RECORD_SIZE``), started after the last
  forward of the window and read on the host once after its last backward, with O(1) host work. It overlaps the last
  backward; on one NCCL communicator it runs before the gradient buckets, so it delays them by its own time, which
  shows only when the gradient all-reduce outlasts the backward. Tracked rank counts (``DenominatorMonitor``) add P
  slots to the record and O(P) host work.

Collective times follow NCCL's own tuning model (``src/graph/tuning.cc``, NVIDIA/nccl commit 01afd20, a 2020 release):
per algorithm (ring; tree for all-reduce) and protocol (LL, LL128, Simple), latency = base + intra-node steps × the
NVLink hop latency + inter-node steps × the network hop latency (a ring all_gather has P − 1 steps of which
nodes − 1 cross the network), time = latency + bytes / bandwidth, and NCCL takes the fastest. 8 GPUs per node,
bus bandwidth 370 GB/s on NVLink and 50 GB/s per GPU across nodes (one 400 Gb/s NIC per GPU). Host costs are
measured here, on this machine's CPU, with the package's own code (new) and a copy of the old code's host side.
Step time: K = 1 (the worst case: more micro-batches lengthen the step, not the exchange), 16,384 tokens per GPU per
micro-batch, 6 · parameters · tokens FLOPs at 40 % of an H100's 989 bf16 TFLOP/s, backward = 2/3 of it, bf16
gradients; step = forward + backward + the part of the gradient all-reduce the backward does not hide.

    .venv/bin/python benchmarks/scale_model.py            # ~1 min (host timings up to P = 131,072)
    .venv/bin/python benchmarks/scale_model.py --quick    # ~5 s, into a temporary folder
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    add_output_arguments,
    environment,
    environment_markdown,
    markdown_table,
    output_paths,
    write_results,
)

from token_mean import WindowStats
from token_mean._layout import World
from token_mean._record import RECORD_SIZE, Kind, Reduced

# ---------------------------------------------------------------------------------------------------------------
# NCCL's tuning model (tuning.cc at commit 01afd20): µs and GB/s, per protocol (LL, LL128, Simple)
# ---------------------------------------------------------------------------------------------------------------

PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LATENCY = {"tree": (4.4, 4.4, 0.0), "ring": (3.6, 10.0, 8.4)}
HOP_LATENCY = {
    "nvlink": {"tree": (0.52, 1.2, 28.0), "ring": (0.47, 1.9, 3.4)},
    "net": {"tree": (5.0, 8.5, 50.0), "ring": (2.7, 4.0, 9.6)},
}
# "Trees are not perfectly sticking to the model for medium sizes": bandwidth factors for 64 B · 2**i, i = 0..21
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
)
GPUS_PER_NODE = 8
BUS_GBPS_NVLINK = 370.0  # H100 NVLink, NCCL bus bandwidth within a node
BUS_GBPS_NET = 50.0  # per GPU across nodes: one 400 Gb/s NDR NIC per GPU (DGX/HGX H100)


def _log2i(value: int) -> int:
    return max(value, 1).bit_length() - 1


def nccl_seconds(collective: str, nbytes: int, ranks: int) -> float:
    """NCCL's predicted time of one ``all_reduce`` of ``nbytes`` or ``all_gather`` of ``nbytes`` per rank."""
    if ranks == 1:
        return 0.0
    nodes = max(1, ranks // GPUS_PER_NODE)
    per_node = ranks // nodes
    all_reduce = collective == "all_reduce"
    steps = 2 * (ranks - 1) if all_reduce else ranks - 1
    inter_steps = 2 * (nodes - 1) if all_reduce else nodes - 1
    total_bytes = nbytes if all_reduce else nbytes * ranks
    best = math.inf
    for algorithm in ("ring", "tree") if all_reduce else ("ring",):
        for index, protocol in enumerate(PROTOCOLS):
            bus = BUS_GBPS_NVLINK if nodes == 1 else BUS_GBPS_NET
            if algorithm == "ring" and protocol == "LL":
                bus *= 1 / 4 if nodes > 1 or all_reduce else 1 / 3
            if algorithm == "ring" and protocol == "LL128":
                bus *= 0.92
            if algorithm == "tree":
                bus = min(bus * 0.9, 80.0 if nodes > 2 else 110.0)
                bus *= {"LL": 1 / 3.8, "LL128": 0.915 if nodes > 1 else 7 / 9, "Simple": 1.0}[protocol]
            bandwidth = bus * (0.5 if algorithm == "tree" else ranks / steps)
            latency = BASE_LATENCY[algorithm][index]
            intra = HOP_LATENCY["nvlink"][algorithm][index] * (1.8 if nodes > 1 and protocol == "LL" else 1.0)
            inter = HOP_LATENCY["net"][algorithm][index]
            if algorithm == "ring":
                latency += (steps - inter_steps) * intra + inter_steps * inter
                if protocol == "Simple" and nodes > 1 and all_reduce and total_bytes >= ranks / 16 * 65536:
                    latency *= 1.9  # "plateau effect of ring"
            else:
                latency += 2 * ((per_node - 1) * intra + _log2i(nodes) * inter)
                size_class = _log2i(total_bytes >> 6)
                if size_class < 22:
                    bandwidth *= TREE_CORRECTION[index][size_class]
            best = min(best, latency + total_bytes / (1000 * bandwidth))
    return best * 1e-6


# ---------------------------------------------------------------------------------------------------------------
# host work per window, measured
# ---------------------------------------------------------------------------------------------------------------

OLD_RECORD = 10  # count, loss sum, length, 7 problem flags
OLD_FLAGS, OLD_COUNT, OLD_LOSS, OLD_LENGTH = 3, 0, 1, 2


def old_host_work(gathered: torch.Tensor, world_size: int) -> None:
    """The host side of one old gather (commit d8a6f94, ``strategy.py``: ``_exchange``, ``_raise_if_problems``,
    ``_counts_of`` / ``_finish_window``): the P rows as Python lists, every rank's flags looked at, the set of window
    lengths, the per-rank counts as a tuple and two ``fsum``s. Lookahead ran it twice per window."""
    rows = gathered.view(world_size, -1).tolist()
    messages = [f"rank {rank}" for rank, row in enumerate(rows) for index in range(7) if row[OLD_FLAGS + index]]
    if len({row[OLD_LENGTH] for row in rows}) > 1:
        messages.append("lengths")
    rank_counts = tuple(row[OLD_COUNT] for row in rows)
    global_count = math.fsum(rank_counts)
    loss = math.fsum(row[OLD_LOSS] for row in rows) / global_count
    WindowStats(global_count, rank_counts[0], rank_counts, 4, loss, False, "lookahead")


def new_host_work(record: torch.Tensor, world_size: int, monitor: bool) -> None:
    """The host side of the new design's window end (``Exchange.read`` → ``Reduced`` → problems, lengths, stats),
    with the package's own code; ``monitor``: the P rank slots and the monitor's O(P) figures."""
    reduced = Reduced(Kind.WINDOW, record.tolist(), World.single(), [])
    reduced.lines()
    reduced.lengths_agree()
    rank_counts = reduced.rank_counts()
    stats = WindowStats(reduced[0], 1.0, rank_counts, 4, reduced[2] / reduced[0], False, "lookahead")
    if monitor and rank_counts is not None:
        _ = (min(rank_counts), max(rank_counts), stats.imbalance, stats.naive_weight_error)


def host_seconds(work: Callable[[], None], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``work``, after one untimed call: the code's own cost (as ``timeit``
    advises; on a shared machine slower calls measure the other processes, and a median of 15 moved 2.7× between
    runs here)."""
    work()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def measure_host(world_sizes: list[int], repeat: int) -> dict[int, dict[str, float]]:
    measured = {}
    for ranks in world_sizes:
        gathered = torch.rand(ranks * OLD_RECORD, dtype=torch.float64) + 1.0
        gathered.view(ranks, -1)[:, OLD_FLAGS:] = 0.0
        gathered.view(ranks, -1)[:, OLD_LENGTH] = 4.0
        record = torch.zeros(RECORD_SIZE, dtype=torch.float64)
        record[0], record[2] = 1000.0, 2000.0
        tracked = torch.cat([record, torch.rand(ranks, dtype=torch.float64)])
        measured[ranks] = {
            "old_per_gather_s": host_seconds(lambda g=gathered, p=ranks: old_host_work(g, p), repeat),
            "new_s": host_seconds(lambda r=record, p=ranks: new_host_work(r, p, monitor=False), repeat),
            "new_tracked_s": host_seconds(lambda r=tracked, p=ranks: new_host_work(r, p, monitor=True), repeat),
        }
    return measured


# ---------------------------------------------------------------------------------------------------------------
# step time and exposed time
# ---------------------------------------------------------------------------------------------------------------

MODELS = {"125M": 125e6, "1B": 1e9, "7B": 7e9}
TOKENS = 16_384  # per GPU per micro-batch
PEAK_FLOPS, MFU = 989e12, 0.4
GRADIENT_BYTES = 2  # bf16
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
THRESHOLD = 0.01


def step_parts(parameters: float, ranks: int) -> dict[str, float]:
    """Forward, backward, gradient all-reduce and step time for K = 1."""
    compute = 6 * parameters * TOKENS / (PEAK_FLOPS * MFU)
    forward, backward = compute / 3, 2 * compute / 3
    gradient_bytes = parameters * GRADIENT_BYTES
    buckets = math.ceil(gradient_bytes / BUCKET_BYTES)
    gradient = buckets * nccl_seconds("all_reduce", BUCKET_BYTES, ranks)
    return {"forward": forward, "backward": backward, "gradient": gradient,
            "step": forward + backward + max(0.0, gradient - backward)}


def exposed(parameters: float, ranks: int, host: dict[str, float]) -> dict[str, float]:
    """Exposed seconds per window: old (2 blocking gathers + 2 × O(P) host), new, new with tracked rank counts."""
    parts = step_parts(parameters, ranks)
    old = 2 * (nccl_seconds("all_gather", OLD_RECORD * 8, ranks) + host["old_per_gather_s"])

    def overlapped(exchange: float) -> float:
        # the exchange queues before the gradient buckets on the communicator, all overlapping the last backward
        tail_with = max(0.0, exchange + parts["gradient"] - parts["backward"])
        return tail_with - max(0.0, parts["gradient"] - parts["backward"])

    new = overlapped(nccl_seconds("all_reduce", RECORD_SIZE * 8, ranks)) + host["new_s"]
    tracked = overlapped(nccl_seconds("all_reduce", (RECORD_SIZE + ranks) * 8, ranks)) + host["new_tracked_s"]
    return {"step": parts["step"], "old": old, "new": new, "new_tracked": tracked}


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def fmt_share(share: float) -> str:
    return f"{share:.1%}" if share >= 0.001 else f"{share:.3%}"


def first_over(host: dict[int, dict[str, float]], parameters: float, design: str) -> int | None:
    for ranks in sorted(host):
        if ranks >= GPUS_PER_NODE:
            times = exposed(parameters, ranks, host[ranks])
            if times[design] > THRESHOLD * times["step"]:
                return ranks
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "scale_model")
    args = parser.parse_args()
    json_path, markdown_path = output_paths(args, "scale_model")
    torch.set_num_threads(1)
    largest = 16_384 if args.quick else 131_072
    world_sizes = [2**i for i in range(3, largest.bit_length())]
    table_sizes = [p for p in world_sizes if p <= 16_384]
    env = environment({
        "nccl_model": "src/graph/tuning.cc at NVIDIA/nccl 01afd20: LL/LL128/Simple, ring (+tree for all_reduce)",
        "gpus_per_node": GPUS_PER_NODE, "bus_GBps_nvlink": BUS_GBPS_NVLINK, "bus_GBps_net": BUS_GBPS_NET,
        "old_record_float64": OLD_RECORD, "new_record_float64": RECORD_SIZE, "tokens_per_gpu_micro_batch": TOKENS,
        "peak_flops": PEAK_FLOPS, "mfu": MFU, "gradient_bytes": GRADIENT_BYTES, "bucket_bytes": BUCKET_BYTES,
        "models": MODELS, "accumulate": 1, "threshold": THRESHOLD, "host_repeats": 3 if args.quick else 15,
        "quick": args.quick,
    })
    started = time.perf_counter()
    host = measure_host(world_sizes, repeat=3 if args.quick else 15)

    collective_rows = []
    for ranks in table_sizes:
        measured = host[ranks]
        gather = nccl_seconds("all_gather", OLD_RECORD * 8, ranks)
        collective_rows.append([
            f"{ranks:,}", ranks // GPUS_PER_NODE or 1, fmt_seconds(gather), fmt_seconds(measured["old_per_gather_s"]),
            fmt_seconds(2 * (gather + measured["old_per_gather_s"])),
            fmt_seconds(nccl_seconds("all_reduce", RECORD_SIZE * 8, ranks)), fmt_seconds(measured["new_s"]),
            fmt_seconds(nccl_seconds("all_reduce", (RECORD_SIZE + ranks) * 8, ranks)),
            fmt_seconds(measured["new_tracked_s"]),
        ])
    share_rows = []
    for ranks in table_sizes:
        row: list[Any] = [f"{ranks:,}"]
        for parameters in MODELS.values():
            times = exposed(parameters, ranks, host[ranks])
            row += [fmt_seconds(times["step"]), fmt_share(times["old"] / times["step"]),
                    fmt_share(times["new"] / times["step"]), fmt_share(times["new_tracked"] / times["step"])]
        share_rows.append(row)
    thresholds = {
        name: {design: first_over(host, parameters, design) for design in ("old", "new", "new_tracked")}
        for name, parameters in MODELS.items()
    }
    beyond = f"> {largest:,}"
    threshold_rows = [
        [name, *(f"{found:,}" if found else beyond for found in designs.values())]
        for name, designs in thresholds.items()
    ]
    markdown = "\n\n".join([
        "### Scale model: the strategy's exposed time per optimizer step, old design vs new",
        environment_markdown(env),
        f"Per window, {GPUS_PER_NODE} GPUs per node. Collectives: NCCL's tuning model; host: measured here (fastest"
        f" of {env['configuration']['host_repeats']}). Old = 2 × (ring all_gather of the {OLD_RECORD}-float64 record +"
        f" host work on the P gathered rows), all exposed. New = one all_reduce of the {RECORD_SIZE}-float64 record"
        " (P more slots with tracked rank counts) + the host read after the last backward.",
        markdown_table(
            ["P", "nodes", "old: all_gather", "old: host / gather", "old: exposed / window", "new: all_reduce",
             "new: host", "new + rank counts: all_reduce", "new + rank counts: host"],
            collective_rows,
        ),
        f"Exposed time as a share of the step (K = 1, {TOKENS:,} tokens per GPU per micro-batch, {MFU:.0%} MFU of"
        f" {PEAK_FLOPS / 1e12:.0f} TFLOP/s; the new exchange overlaps the last backward and counts only where it"
        " lengthens the gradient all-reduce's exposed tail, plus its host read):",
        markdown_table(
            ["P", *(f"{name} {column}" for name in MODELS for column in ("step", "old", "new", "new + counts"))],
            share_rows,
        ),
        f"First P (powers of two from {GPUS_PER_NODE}) where the exposed time exceeds {THRESHOLD:.0%} of the step:",
        markdown_table(["model", "old design", "new design", "new + rank counts (monitor)"], threshold_rows),
    ])
    payload = {
        "environment": env, "host_seconds": {str(p): v for p, v in host.items()}, "thresholds": thresholds,
        "exposed": {name: {str(p): exposed(params, p, host[p]) for p in world_sizes if p >= GPUS_PER_NODE}
                    for name, params in MODELS.items()},
        "collectives_seconds": {str(p): {"old_all_gather": nccl_seconds("all_gather", OLD_RECORD * 8, p),
                                         "new_all_reduce": nccl_seconds("all_reduce", RECORD_SIZE * 8, p)}
                                for p in world_sizes},
    }
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
