"""The trace's fingerprints, grad_norm and param_norm: one fused pass each per step, and close to float64 norms."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _fabric import fabric_for, launched, setup
from _harness import TokenModule, initial_state, ragged_batches
from _monitor_helpers import trainer_for

import token_mean._fingerprint
from token_mean._fingerprint import NORM_ROW
from token_mean._fingerprint import global_norm as _global_norm
from token_mean._trace import read_trace
from token_mean.callback import DenominatorMonitor

CPU = torch.device("cpu")


def float64_norm(tensors: list[torch.Tensor]) -> float:
    """Plain reference: every element squared and summed in float64."""
    return math.sqrt(math.fsum(float(t.detach().double().square().sum()) for t in tensors))


def some_tensors(dtype: torch.dtype, large: bool = True) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # many rows; less than one row; whole rows and a remainder; empty
    shapes = [(1024, 1024) if large else (64, 64), (3,), (NORM_ROW * 5 + 7,), (0,)]
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


@pytest.mark.parametrize(
    ("dtype", "rel"),
    [
        (torch.float32, 1e-8),  # the CPU kernel on whole tensors is 9e-6 off on the 1M-element one
        (torch.float64, 1e-14),  # 64-true: float64 fingerprints, so tight tolerances still compare training
        (torch.bfloat16, 1e-7),  # accumulated in float32 (about its rounding), not to bfloat16's three digits
    ],
)
def test_global_norm_is_close_to_float64(dtype: torch.dtype, rel: float) -> None:
    tensors = some_tensors(dtype)
    norm = _global_norm(tensors, CPU)
    assert norm is not None and norm.dtype == torch.float64
    assert float(norm) == pytest.approx(float64_norm(tensors), rel=rel)
    assert _global_norm([], CPU) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fused_path_of_accelerators(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `torch._foreach_norm` path that GPUs take, run on the CPU with tensors small enough to add exactly."""
    monkeypatch.setattr(token_mean._fingerprint, "ROW_NORM_DEVICES", ())
    tensors = some_tensors(dtype, large=False)
    calls = count_elements(monkeypatch)
    norm = _global_norm(tensors, CPU)
    assert norm is not None and float(norm) == pytest.approx(float64_norm(tensors), rel=1e-6)
    assert calls == {"_foreach_norm": sum(t.numel() for t in tensors)}  # one fused call, every element once


def count_elements(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Elements read by each norm function the fingerprint may use (looked up at call time, so patched here)."""
    counts: dict[str, int] = {}

    def counting(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapper(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            read = sum(t.numel() for t in tensors) if isinstance(tensors, list | tuple) else tensors.numel()
            counts[name] = counts.get(name, 0) + read
            return real(tensors, *args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    counting(torch, "_foreach_norm")
    counting(torch.linalg, "vector_norm")
    return counts


def test_global_norm_reads_each_element_once(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = some_tensors(torch.float32)
    calls = count_elements(monkeypatch)
    _global_norm(tensors, CPU)
    assert calls == {"vector_norm": sum(t.numel() for t in tensors)}


def test_recorded_fingerprints_are_one_pass_each_and_exact_in_float64(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = TokenModule(ragged_batches(1, 4, seed=5))
    trace = tmp_path / "trace.csv"
    trainer = trainer_for(tmp_path, accumulate_grad_batches=2, callbacks=[DenominatorMonitor(record=trace)])
    calls = count_elements(monkeypatch)
    trainer.fit(module)

    parameters = list(module.parameters())
    numel = sum(p.numel() for p in parameters)
    assert calls == {"vector_norm": 2 * 2 * numel}  # 2 steps × (the gradients, then the parameters), once each
    last = read_trace(trace)[1]
    # The harness' model is float64: its fingerprints are float64 norms, as a plain reference computes them.
    assert last["param_norm"] == pytest.approx(float64_norm(parameters), rel=1e-14)
    # Lightning zeroes gradients at the start of a step, so the last step's are still there.
    grads = [p.grad for p in parameters if p.grad is not None]
    assert last["grad_norm"] == pytest.approx(float64_norm(grads), rel=1e-14)


def _norms_on_every_rank(fabric: Any) -> list[float]:
    """The parameters' and the gradients' global_norm of a sharded model, each as its largest and smallest value over
    the ranks, and the gradients' float64 norm gathered whole."""
    from torch.distributed.tensor import DTensor

    model, _ = setup(fabric)
    torch.manual_seed(0)
    model(torch.randn(3, 4, 5, dtype=torch.float64)).square().sum().backward()
    values = []
    for tensors in ([p.detach() for p in model.parameters()], [p.grad for p in model.parameters()]):
        norm = _global_norm(tensors, fabric.device)
        assert norm is not None
        extremes = torch.stack([norm, -norm])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        values += [float(extremes[0]), -float(extremes[1])]
    gradients = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    return [*values, float64_norm(gradients)]


@pytest.mark.distributed
@pytest.mark.parametrize(("devices", "tensor_parallel"), [(2, 1), (4, 2)], ids=["fsdp2", "fsdp2xtp"])
def test_a_sharded_model_has_the_whole_models_norms(devices: int, tensor_parallel: int) -> None:
    """FSDP2 shards the 7-row output layer unevenly (4 and 3 rows), and over a tensor-parallel shard as a
    `_StridedShard`: every rank gets the norm of the whole parameters and gradients, not its shard's (or a reshape
    error, or a collective that only rank 0 joins)."""
    fabric = fabric_for("fsdp", devices, tensor_parallel)
    largest, smallest, largest_grad, smallest_grad, whole_grad = launched(fabric, _norms_on_every_rank)
    expected = float64_norm(list(initial_state().values()))
    assert largest == smallest and largest_grad == smallest_grad  # the same on every rank
    assert largest == pytest.approx(expected, rel=1e-14)
    assert largest_grad == pytest.approx(whole_grad, rel=1e-14)
