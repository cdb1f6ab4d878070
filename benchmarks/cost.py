"""Cost in counts, not seconds: collectives, host reads and dispatched aten ops of each mode against plain DDP.

Two forked gloo CPU processes train the test suite's token model (``tests/_harness.py``) for 3 epochs of 3 windows of
K = 4 micro-batches, with a sized loader (a ``Dataset``) and an unsized one (an ``IterableDataset``), with and without
``DenominatorMonitor``; plain ``DDPStrategy`` runs in the same harness. A second table counts
``TokenMeanAccumulator`` in a LitGPT-shaped Fabric loop (``tests/_fabric.py``, Fabric's ``DDPStrategy``, the same data,
K and passes, loaders through ``fabric.setup_dataloaders``) against LitGPT's own loop. ``tests/_cost.py`` counts,
inside the workers, every c10d collective and aten op dispatched on the training thread and every host read of a
tensor's values (``item``/``bool``/``float``, ``tolist``, ``numpy``, ``cpu``), and files each under its micro-batch,
window and epoch (``tests/_fabric_cost.py`` tells it a Fabric loop's). ``tests/test_cost.py`` pins the same numbers,
so a regression fails the suite; this script records them.

The counts are exact and do not depend on the machine's load: no warm-up or repetition is needed.

    .venv/bin/python benchmarks/cost.py            # ~15 s -> benchmarks/results/cost.{json,md}
    .venv/bin/python benchmarks/cost.py --quick    # the same runs, written to a temporary folder
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

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
from _cost import ACCUMULATE, DEVICES, EPOCHS, LOADERS, TABLE_HEADERS, WINDOWS_PER_EPOCH, measure, table_rows
from _fabric_cost import measure as measure_fabric

# Workers are forked from this process: one intra-op thread, set before any torch op (see fidelity.py).
torch.set_num_threads(1)

READING = """\
Per rank, P = {devices}, K = {accumulate}: a window is one optimizer step ({accumulate} micro-batches); "per epoch" is \
what an epoch costs besides its windows (its start and end). The first row of each loader is plain `DDPStrategy` in \
absolute numbers; every other row is the **extra** over it (same loader, no monitor), so Lightning's own costs are \
netted out: under DDP it broadcasts a SIGTERM flag and reads it with `.item()` before every batch (the 4 broadcasts \
and 4 reads per window of the plain row). DDP's gradient all-reduce ({gradient} per window here, one bucket) is the \
same in every run and left out; in deferred mode it runs in the strategy's comm hook instead of DDP's C++ reducer. \
"(+n count_fn, CPU batch)": lookahead's host reads of its count of the next window's batches as the loader \
yielded them, before they move to the device, which never wait for a device; deferred mode counts the batch \
`training_step` received on its device, with no read; "(n the count)": the ops of the count itself \
(`count_valid_labels`: `ne`, `sum`; lookahead counts each batch once, read ahead, and again as `training_step` \
received it only when a hook moved or changed its tensors).

- **Host reads between a window's first forward and its last backward: 0** in both modes, both loaders, with and \
without the monitor, except the label counts' reads of host batches above. The window's record is read \
once per window, after its last backward (in the strategy's `backward` hook).
- **Collectives: one all-reduce per window** (the record), plus per epoch: lookahead's first-window counts (before any \
forward) and, for unsized loaders, one has-a-batch all-reduce. A stream's end rides in each window's record in both \
modes (deferred mode peeks one batch before the last backward, from a loader known to yield fresh memory).
- **Ops per micro-batch**: lookahead {look_micro} (scaling the loss by a host float, and that product's backward); \
deferred {deferred_micro} (the count, detaching the loss, \
the scale, the loss times it and its backward). The rest is once per window: counting the next window's batches \
(lookahead), building, exchanging and reading the record (lookahead {look_end}, deferred {deferred_end} more ops per \
window, gradient factor and comm hook included).
- `DenominatorMonitor` adds no collective and no host read under the strategy (it reads `strategy.last_window`; \
asking for per-rank counts costs {monitor_ops} ops and P more slots in the record per window). Under plain DDP it \
measures the window itself with a window record: one all-reduce and one read per window, after the step.
"""

FABRIC_READING = """\
`TokenMeanAccumulator` in a LitGPT-shaped Fabric loop (`tests/_fabric.py`: `no_backward_sync`, the shifted loss, \
`count_shifted_labels`, 3 ops), Fabric's `DDPStrategy` on the same {devices} forked gloo processes, data, K = \
{accumulate} and passes, each rank's batches through `fabric.setup_dataloaders`. The first row of each loader is \
LitGPT's own loop, `fabric.backward(loss / K)`, in absolute numbers (Fabric adds no collective or read to a step; per \
pass the DataLoader reads its base seed); the others are the extra over it. "Per epoch" is per pass of \
`accumulator.batches(loader)`.

- **One all-reduce per window** and **no host read between a window's first forward and its last backward** in \
both modes, except lookahead's reads of its counts of host batches (the next window's, beneath a loader that moves \
them, moving each as the loop takes it). The \
window's record is read once, in `accumulator.finish()`, after the last backward.
- **Per pass**: the ranks agree on the loader's length (a stream: that every rank is unsized, and that each holds \
batches), plus lookahead's first-window counts.
- **Ops per micro-batch**: lookahead {look_micro} (the loss times a host float in place of LitGPT's `loss / K`), \
deferred {deferred_micro} (the count, detaching the loss, the scale and its backward, in place of \
LitGPT's `loss / K` and its backward); lookahead {look_end} and \
deferred {deferred_end} more per window.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "cost")
    args = parser.parse_args()
    json_path, markdown_path = output_paths(args, "cost")
    quiet_lightning()
    env = environment({
        "devices": DEVICES, "accumulate": ACCUMULATE, "epochs": EPOCHS, "windows_per_epoch": WINDOWS_PER_EPOCH,
        "model": "tests/_harness.py TokenNet on sft_batches('sft') (no empty micro-batch), SGD",
        "backend": "gloo, fork",
        "loaders": {"sized": "DataLoader(ListDataset)", "unsized": "DataLoader(StreamDataset), an IterableDataset"},
        "counting": "tests/_cost.py: TorchDispatchMode (aten, c10d) + Tensor.tolist/numpy/cpu, per rank",
        "fabric": "tests/_fabric.py loops (LitGPT's, TokenMeanAccumulator), Fabric DDPStrategy(start_method='fork'),"
                  " shifted loss and count_shifted_labels, loaders through fabric.setup_dataloaders",
    })
    started = time.perf_counter()
    rows, fabric_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for loader in LOADERS:
            rows += measure(loader, Path(tmp))
            fabric_rows += measure_fabric(loader, Path(tmp))
    by_name = {(r.loader, r.method, r.monitor): r.cost for r in rows}
    look, deferred = by_name["sized", "lookahead", False], by_name["sized", "deferred", False]
    plain = by_name["sized", "plain", False]
    reading = READING.format(
        devices=DEVICES, accumulate=ACCUMULATE,
        gradient=", ".join(f"{n} {name}" for name, n in plain.gradient_per_window.items()),
        look_micro=look.ops_per_micro_batch, deferred_micro=deferred.ops_per_micro_batch,
        look_end=look.ops_per_window - ACCUMULATE * look.ops_per_micro_batch,
        deferred_end=deferred.ops_per_window - ACCUMULATE * deferred.ops_per_micro_batch,
        monitor_ops=by_name["sized", "lookahead", True].ops_per_window - look.ops_per_window,
    )
    fabric = {(r.loader, r.method): r.cost for r in fabric_rows}
    fabric_look, fabric_deferred = fabric["sized", "lookahead"], fabric["sized", "deferred"]
    fabric_reading = FABRIC_READING.format(
        devices=DEVICES, accumulate=ACCUMULATE, look_micro=fabric_look.ops_per_micro_batch,
        deferred_micro=fabric_deferred.ops_per_micro_batch,
        look_end=fabric_look.ops_per_window - ACCUMULATE * fabric_look.ops_per_micro_batch,
        deferred_end=fabric_deferred.ops_per_window - ACCUMULATE * fabric_deferred.ops_per_micro_batch,
    )
    markdown = "\n\n".join([
        "### Cost: collectives, host reads and aten ops per micro-batch, window and epoch (2 gloo processes)",
        environment_markdown(env),
        markdown_table(TABLE_HEADERS, table_rows(rows)),
        reading.strip(),
        "#### Fabric: TokenMeanAccumulator against LitGPT's loop",
        markdown_table(TABLE_HEADERS, table_rows(fabric_rows)),
        fabric_reading.strip(),
    ])
    payload = {
        "environment": env,
        "rows": [{"loader": r.loader, "method": r.method, "monitor": r.monitor, **asdict(r.cost)} for r in rows],
        "fabric_rows": [{"loader": r.loader, "method": r.method, **asdict(r.cost)} for r in fabric_rows],
    }
    write_results(json_path, markdown_path, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {markdown_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
