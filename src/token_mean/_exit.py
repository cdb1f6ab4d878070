"""Destroy and free the default process group before the interpreter finalizes, so a finished job exits with 0.

A gloo group's worker threads outlive ``destroy_process_group()`` while anything still references the group (it only
leaves torch's registry). A worker that finishes a collective whose tensor Python also holds must take the GIL to
drop it; if the interpreter has begun to finalize by then, the thread exits inside C++ and the process aborts
("terminate called without an active exception", SIGABRT) after training finished and its results were written: a
scheduler marks the job failed. Lightning keeps the group after ``fit`` (a second ``fit`` reuses it), so the package
ends it at interpreter exit instead, for every process that trained with it: ``atexit`` handlers run before the
interpreter finalizes, last registered first. Destroying is not enough: the DDP wrappers Lightning drops at teardown
sit in reference cycles that hold the group, so the handler collects them too, and the group's destructor joins its
threads while the interpreter is whole. (The package's own DDP hook keeps its state weakly for the same reason:
``_ddp.InReduction``.) A DDP-wrapped model the user's own code still holds keeps the group alive past this point.
The handler collects also when the group was destroyed before it ran (a script's own ``destroy_process_group()`` at
the end of training, which torch recommends, leaves the same cycles). Spawned workers finalize as a script does, so
the handler runs there too; forked workers leave with ``os._exit``, which runs no handler and does not finalize.
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
    # Also when the user's code destroyed the group itself, as torch asks scripts to: that only unregistered it, and
    # the unreachable wrappers' cycles still hold it (module docstring). A full collection at exit: ~10-100 ms once.
    gc.collect()
