"""Destroy the default process group before the interpreter finalizes, so a finished job exits with status 0.

A process that exits with a live gloo process group aborts about one run in three while the interpreter finalizes
("terminate called without an active exception", SIGABRT: the group's threads are destroyed while still joinable),
after training has finished and its results are written; a scheduler then marks the job failed. Lightning keeps the
group alive after ``fit`` (a second ``fit`` reuses it), so the package destroys it at interpreter exit instead, for
every process that trained with it: ``atexit`` handlers run before the interpreter finalizes, last registered first.
Forked and spawned workers leave with ``os._exit``, which runs no ``atexit`` handler and does not finalize either.
"""

from __future__ import annotations

import atexit

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
