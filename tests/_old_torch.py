"""What the suite adds to torch releases before 2.7 so that FSDP2 runs on the CPU, as it does from 2.7 on.

torch 2.6's FSDP2 calls ``record_event()`` and ``wait_event()`` on the device's streams on every device, but its CPU
stub ``torch.cpu.Stream`` lacks both: on gloo it fails with "'Stream' object has no attribute 'record_event'"
(plain ``ModelParallelStrategy`` too). 2.7 added them to the stub as no-ops returning None, and FSDP2 treats a None
event as "nothing to wait for". The suite runs FSDP2 on the CPU, so on 2.6 it adds the same two no-ops. Nothing else
changes: on a GPU, torch 2.6's FSDP2 uses CUDA streams. Imported by ``conftest.py`` and ``_harness.py`` (so the
launched scripts of ``tests/scripts`` get it too); the package itself does not patch torch, and neither do the
examples and benchmarks, whose FSDP2 runs on the CPU are skipped there (``FSDP2_RUNS_ON_CPU``).
"""

from __future__ import annotations

from typing import Any

import torch


def _record_event(self: Any, event: Any = None) -> None:
    return None


def _wait_event(self: Any, event: Any) -> None:
    return None


FSDP2_RUNS_ON_CPU = hasattr(torch.cpu.Stream, "record_event")  # unpatched torch: 2.7 on
NO_FSDP2_ON_CPU = (
    "torch 2.6's FSDP2 does not run on the CPU ('Stream' object has no attribute 'record_event'); the script is not"
    " patched as the suite is"
)

if not FSDP2_RUNS_ON_CPU:  # torch < 2.7
    torch.cpu.Stream.record_event = _record_event  # type: ignore[attr-defined]
    torch.cpu.Stream.wait_event = _wait_event  # type: ignore[attr-defined]
