"""The GPU lane's helpers: a ``RunIf``-style skip for tests that need CUDA, and a way to use CUDA without touching it.

The pytest process never initializes CUDA: the CPU tests fork their workers from it, and a process with a CUDA
context cannot fork one that uses CUDA (Lightning's fork launcher refuses to, torch's lazy init raises in the child).
So the counting here goes through NVML (``torch.cuda.device_count`` does not poison fork when NVML answers), and a
test's CUDA work runs in another process: Lightning's subprocess launcher for a fit, :func:`in_spawned_process` for
anything else.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import torch

Test = TypeVar("Test", bound=Callable[..., Any])
T = TypeVar("T")


def cuda_devices() -> int:
    """The CUDA devices this process sees (0 with a CPU build of torch), counted without creating a CUDA context."""
    return torch.cuda.device_count()


def requires_cuda(devices: int = 1) -> Callable[[Test], Test]:
    """Mark a test ``gpu`` and skip it unless at least ``devices`` CUDA devices are visible.

    Example:
        >>> @requires_cuda(devices=2)
        ... def test_two_gpus() -> None: ...
        >>> sorted(mark.name for mark in test_two_gpus.pytestmark)
        ['gpu', 'skipif']
    """
    found = cuda_devices()
    skip = pytest.mark.skipif(
        found < devices, reason=f"needs {devices} CUDA device{'s' if devices > 1 else ''}, found {found}"
    )

    def mark(test: Test) -> Test:
        marked: Test = pytest.mark.gpu(skip(test))
        return marked

    return mark


def in_spawned_process(function: Callable[[], T], timeout: float = 120.0) -> T:
    """``function()`` in a fresh spawned interpreter, its result sent back (``function`` must be importable)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(function).get(timeout)


# ---------------------------------------------------------------------------------------------------------------
# fingerprints on CUDA, computed in a spawned worker
# ---------------------------------------------------------------------------------------------------------------

# name: (dtype, shapes); 16M and 1M elements, less than one row, whole rows and a remainder; and an empty tensor
NORM_CASES: dict[str, tuple[torch.dtype, list[tuple[int, ...]]]] = {
    "float32": (torch.float32, [(4096, 4096), (1024, 1024), (3,), (5 * 1024 + 7,)]),
    "bfloat16": (torch.bfloat16, [(4096, 4096), (1024, 1024), (3,), (5 * 1024 + 7,)]),
    "float32-with-an-empty-tensor": (torch.float32, [(0,), (3,), (64, 64)]),
}


@contextmanager
def elements_read() -> Iterator[dict[str, int]]:
    """Count the elements each norm function ``global_norm`` may use reads (both are looked up at call time)."""
    read = {"_foreach_norm": 0, "vector_norm": 0}
    functions = {"_foreach_norm": (torch, torch._foreach_norm), "vector_norm": (torch.linalg, torch.linalg.vector_norm)}

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(given: Any, *args: Any, **kwargs: Any) -> Any:
            read[name] += sum(t.numel() for t in given) if isinstance(given, list | tuple) else given.numel()
            return original(given, *args, **kwargs)

        return counted

    for name, (owner, original) in functions.items():
        setattr(owner, name, counting(name, original))
    try:
        yield read
    finally:
        for name, (owner, original) in functions.items():
            setattr(owner, name, original)


def cuda_norm_cases() -> dict[str, dict[str, Any]]:
    """``token_mean._fingerprint.global_norm`` of CUDA tensors for each of :data:`NORM_CASES`, beside the float64
    norm of the same values (every element squared and summed in float64 on the CPU), and the elements each norm
    function read: on CUDA all of them should go through the fused ``torch._foreach_norm``, none row by row."""
    from token_mean._fingerprint import global_norm

    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, Any]] = {}
    for name, (dtype, shapes) in NORM_CASES.items():
        tensors = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
        reference = math.sqrt(math.fsum(float(t.double().square().sum()) for t in tensors))
        on_device = [t.to(device) for t in tensors]
        try:
            with elements_read() as read:
                norm = global_norm(on_device, device)
            assert norm is not None
            results[name] = {
                "norm": float(norm), "reference": reference, "dtype": str(norm.dtype), "device": norm.device.type,
                "elements": sum(t.numel() for t in tensors), "read": read,
            }
        except Exception as error:  # sent back as text: the test names it
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    return results


__all__ = ["NORM_CASES", "cuda_devices", "cuda_norm_cases", "elements_read", "in_spawned_process", "requires_cuda"]
