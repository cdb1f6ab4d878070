"""``TokenMeanAccumulator`` in a LitGPT-shaped Fabric loop against the plain-torch float64 reference (1e-12).

Every case runs the loop of ``tests/_fabric.py`` on forked workers (Fabric's ``DDPStrategy``, and
``ModelParallelStrategy`` with FSDP2 over the data-parallel ranks and tensor parallelism over the others) or on one
device, and compares the final parameters with ``_harness.reference_steps`` over the same windows (the shifted loss,
counted by ``count_shifted_labels``). LitGPT's own loop, ``fabric.backward(loss / K)``, is the control that must miss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _cost import collectives_issued
from _fabric import (
    accumulator_loop,
    every_rank,
    fabric_for,
    forked_ranks,
    launched,
    plain_loop,
    ragged,
    reference,
    subgroups,
)
from _harness import EXACT, MODES, Batch, TokenNet, empty_like, relative_error
from lightning.fabric import Fabric
from torch.nn.parallel import DistributedDataParallel

from token_mean._layout import shared_world

pytestmark = pytest.mark.core  # in `make test-fast`

MISSES = 1e-6

# (layout, devices, tensor-parallel size): DDP, FSDP2 alone (DP = 2), FSDP2 × TP on a 2 × 2 mesh
LAYOUTS = [("ddp", 2, 1), ("fsdp", 2, 1), ("fsdp", 4, 2)]
LAYOUT_IDS = ["ddp", "fsdp2", "fsdp2xtp"]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [*MODES, "plain"])
@pytest.mark.parametrize(("layout", "devices", "tensor_parallel"), LAYOUTS, ids=LAYOUT_IDS)
def test_matches_the_unpartitioned_reference(layout: str, devices: int, tensor_parallel: int, mode: str) -> None:
    """7 ragged batches per data-parallel rank, K = 3 (a short last window), one micro-batch without a target."""
    data = ragged(devices // tensor_parallel, 7, seed=devices + tensor_parallel)
    data[0][1] = empty_like(data[0][1])
    expected, counts = reference(data, 3)
    fabric = fabric_for(layout, devices, tensor_parallel)
    if mode == "plain":
        params = launched(fabric, plain_loop, data, 3)
        assert relative_error(params, expected) > MISSES, "LitGPT's loop matched the token mean: the test cannot fail"
        return
    windows: list[dict[str, Any]] = []
    params, windows = launched(fabric, _with_windows, data, 3, mode)
    assert relative_error(params, expected) < EXACT, f"{layout}/{mode}: {relative_error(params, expected):.3e}"
    assert [window["global_count"] for window in windows] == counts  # over the data-parallel ranks only
    assert all(len(window["rank_counts"] or [0] * (devices // tensor_parallel)) == devices // tensor_parallel
               for window in windows)


def _with_windows(fabric: Any, data: list[list[Batch]], accumulate: int, mode: str) -> tuple[Any, list[Any]]:
    windows: list[dict[str, Any]] = []
    params = accumulator_loop(fabric, data, accumulate, mode, windows=windows)
    return params, windows


@pytest.mark.parametrize("mode", MODES)
def test_one_device(mode: str) -> None:
    data = ragged(1, 7, seed=5)
    expected, counts = reference(data, 3, epochs=2)
    windows: list[dict[str, Any]] = []
    params = accumulator_loop(fabric_for("single"), data, 3, mode, epochs=2, windows=windows)
    assert relative_error(params, expected) < EXACT
    assert [window["global_count"] for window in windows] == counts


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_uneven_ranks_are_padded_with_fillers(layout: str, mode: str) -> None:
    """Rank 1 has 4 batches to rank 0's 7: it yields 3 zero-weight fillers, and every window stays exact."""
    data = ragged(2, 7, seed=8)
    data[1] = data[1][:4]
    expected, _ = reference(data, 3)
    params = launched(fabric_for(layout), accumulator_loop, data, 3, mode)
    assert relative_error(params, expected) < EXACT


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_one_device_in_a_process_with_a_default_group(mode: str, tmp_path: Path) -> None:
    """Two processes that have a gloo default group (the launch initializes it, as ``torchrun`` would for other
    reasons) each train their own model alone on one device, on their own data: each matches its own one-process
    reference, and the accumulator issues no collective (the default group's ranks share no denominator)."""
    data = ragged(2, 7, seed=11)
    results = launched(forked_ranks(), _alone_on_one_device, data, mode, tmp_path)
    for rank, (error, collectives) in enumerate(results):
        assert error < EXACT, f"rank {rank}: {error:.3e} from its own reference"
        assert collectives == {}, f"rank {rank} issued collectives: {collectives}"


def _alone_on_one_device(fabric: Fabric, data: list[list[Batch]], mode: str, directory: Path) -> list[Any]:
    own = [data[fabric.global_rank]]
    params, collectives = collectives_issued(directory, accumulator_loop, Fabric(accelerator="cpu", devices=1), own, 3,
                                             mode)
    expected, _ = reference(own, 3)
    return every_rank((relative_error(params, expected), dict(collectives)))


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_the_world_of_a_ddp_model_is_its_process_group() -> None:
    """The ranks that share the denominator are those DDP reduces the gradients over: a group of one rank is one
    process (rank 1 is rank 0 of its own group), a group of both ranks is their world over that group."""
    worlds = launched(forked_ranks(), _worlds_of_ddp_groups)
    assert worlds == [
        {"own": (1, 0, False, False), "both": (2, rank, True, True), "default": (2, rank, True, True)}
        for rank in range(2)
    ]


def _worlds_of_ddp_groups(fabric: Fabric) -> list[Any]:
    worlds = {}
    for name, group in [*subgroups(fabric).items(), ("default", None)]:
        model = DistributedDataParallel(TokenNet(), process_group=group)
        world = shared_world(fabric.strategy, model)
        worlds[name] = (world.size, world.rank, world.distributed, world.group is model.process_group)
    return every_rank(worlds)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", ["own", "both"])
def test_ddp_over_another_process_group(group: str, mode: str) -> None:
    """Fabric's DDP given a ``process_group`` (its ``DDPStrategy`` kwargs go to ``DistributedDataParallel``): in a
    group of its own each rank matches its own one-process reference; in a group of both ranks (not the default
    group's object) they match the two-rank reference, the record reduced over that group."""
    data = ragged(2, 7, seed=13)
    errors = launched(forked_ranks(), _in_group, data, group, mode)
    for rank, error in enumerate(errors):
        assert error < EXACT, f"rank {rank}: {error:.3e} from its reference"


def _in_group(fabric: Fabric, data: list[list[Batch]], group: str, mode: str) -> list[float]:
    fabric.strategy._ddp_kwargs["process_group"] = subgroups(fabric)[group]  # read as `fabric.setup` wraps the model
    params = accumulator_loop(fabric, data, 3, mode)
    expected, _ = reference([data[fabric.global_rank]] if group == "own" else data, 3)
    return every_rank(relative_error(params, expected))
