"""Destroy and free the default process group before the interpreter finalizes, so a finished job exits with 0.

A gloo group's worker threads outlive ``destroy_process_group()`` while anything references the group; one that
then needs the GIL during finalization aborts the process (SIGABRT) after training succeeded. Lightning keeps the
group after ``fit``, so an ``atexit`` handler destroys it and collects the reference cycles of dropped DDP wrappers
that still hold it (also when a script destroyed it itself), while the interpreter is whole. A DDP model the user
still holds keeps the group alive; forked workers leave with ``os._exit`` and run no handler.
"""

from __future__ import annotations

import atexit
import gc

import torch.distributed as dist

_registered = False


def destroy_process_group_at_exit() -> None:
    """Register (once per process) the destruction of the default process group at interpreter exit."""
    global _registered
    if not _registered:
        atexit.register(_destroy)
        _registered = True


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # Also after the script's own destroy (it only unregisters the group). A full collection: ~10-100 ms, once.
    gc.collect()
