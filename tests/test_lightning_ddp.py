# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Lightning's own CPU-runnable DDP tests, run with ``DDPStrategy`` and with ``TokenMeanDDPStrategy`` swapped in.

Vendored (copied) from https://github.com/Lightning-AI/pytorch-lightning at tag 2.6.5, commit
be98784a1a03581b7051a355ae1084fd352d7cea: the newest 2.6 tag in the mirror (2.6.6 is not tagged there; the installed
lightning 2.6.6 has the same ``strategies/ddp.py``, launchers and training loops). Sources, by section below:
``tests/tests_pytorch/strategies/test_ddp.py``, ``tests/tests_pytorch/strategies/test_ddp_integration.py``,
``tests/tests_pytorch/strategies/launchers/test_multiprocessing.py``, and for gradient accumulation
``tests/tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py``, ``tests/tests_pytorch/trainer/
test_trainer.py``, ``tests/tests_pytorch/trainer/optimization/test_backward_calls.py`` and ``tests/tests_pytorch/
loops/test_training_epoch_loop.py``; the ``mps_count_0`` fixture from ``tests/tests_pytorch/conftest.py``.

Every test runs for each of ``METHODS``: ``plain`` is Lightning's test as it is; ``lookahead`` and ``deferred`` build
``TokenMeanDDPStrategy(mode=..., count_fn=token_mean.count_examples)`` wherever the test built a ``DDPStrategy``.
BoringModel's batches are tensors of one row, so every micro-batch counts 1 and, over full windows, the token mean is
Lightning's mean: Lightning's assertions stand unchanged.

Adapted, and only there: the strategy is built by ``ddp(method, ...)`` instead of ``DDPStrategy(...)`` or a strategy
name (``strategy="ddp"`` -> ``ddp(method)``); a ``DDPStrategy`` subclass in a test derives from
``strategy_class(method)``; ``"ddp_spawn"`` (and the custom launcher's default spawn) becomes ``start_method="fork"``:
a forked worker starts in a fraction of a second, a spawned one re-imports torch (~16 s for two here). Tests Lightning
marks ``standalone`` run forked or in this process, whose process group ``tests/conftest.py`` destroys after each
test. The gradient accumulation tests, which Lightning runs without a strategy on one device, run with DDP on one CPU
process launched in this process (the popen launcher starts no child for one device), so a mock of ``zero_grad`` or
``backward`` still sees every call and Lightning's batch counts and expected numbers stay as they are. Additions,
each marked ``# ours``: the registry test also checks the token-mean names and that Lightning's names still give
``DDPStrategy``; the in-process fits check that the token-mean strategy normalized its windows
(``check_token_mean_ran``); the last section compares final parameters of plain and token-mean DDP.

Expected failure: ``test_backward_count_with_closure`` with the token-mean strategy (``REFUSED``): LBFGS is refused
at fit start, as documented, since it re-runs the closure within one step.

Left out: tests that need CUDA (``test_tensor_init_context``, ``test_ddp_dont_configure_sync_batchnorm``,
``test_multi_gpu_model_ddp_*``, ``test_ddp_wrapper``, ``test_multi_gpu_early_stop_ddp_spawn``,
``test_multi_gpu_model_ddp_spawn``, ``test_ddp_all_dataloaders_passed_to_fit``,
``test_ddp_strategy_checkpoint_zero_redundancy_optimizer``, ``test_model_parameters_on_device_for_optimizer``,
``test_ddp_with_2_gpus``, ``test_ddp_barrier_non_consecutive_device_ids``, ``test_ddp_gradients_synced``,
``launchers/test_subprocess_script.py::test_ddp_with_hydra_runjob``, ``test_ddp_integration_comm_hook.py``): there is
no GPU here to check the token-mean variant on. ``test_ddp_torch_dist_is_available_in_setup``: Lightning runs it on
torch <= 2.7 only. Tests that build no strategy (a ``Mock`` stands in) and so cannot tell the two apart:
``test_multiprocessing_launcher_*``, ``test_global_state_snapshot``, ``test_check_for_missing_main_guard``, both
``test_kill``, ``test_validate_cluster_environment_user_settings``, and the ``GradientAccumulationScheduler`` tests
that never fit (invalid keys and values, unsupported strategies, manual optimization, overridden hooks).
``models/test_cpu.py::test_multi_cpu_model_ddp``: scikit-learn data and Lightning's checkpoint pipelines, no DDP
behaviour of its own. ``test_memory_sharing_disabled`` runs forked, where memory sharing never arises: the spawn case
it is written for costs ~16 s (it passed with plain and lookahead once, by hand).
"""

from __future__ import annotations

import math
import os
from copy import deepcopy
from datetime import timedelta
from typing import Any
from unittest import mock
from unittest.mock import ANY, Mock

import lightning.fabric.accelerators.mps
import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_3
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.multiprocessing import ProcessRaisedException
from torch.nn.parallel import DistributedDataParallel

import token_mean
from token_mean import TokenMeanDDPStrategy

# Every test is bounded: a hung collective fails its test, and tests/conftest.py kills the forked workers it left.
pytestmark = pytest.mark.timeout(60)

# "plain": Lightning's DDPStrategy as its own tests use it; the others: TokenMeanDDPStrategy in that mode, counting
# every row of BoringModel's tensor batches (`count_examples`), so the token mean is Lightning's mean.
METHODS = ("plain", "lookahead", "deferred")
method = pytest.mark.parametrize("method", METHODS)
FORK = {"start_method": "fork"}  # in place of Lightning's "ddp_spawn"


def strategy_class(method: str) -> type[DDPStrategy]:
    """The class a Lightning test builds or subclasses in place of ``DDPStrategy``."""
    return DDPStrategy if method == "plain" else TokenMeanDDPStrategy


def token_mean_kwargs(method: str) -> dict[str, Any]:
    """What ``TokenMeanDDPStrategy`` takes beyond ``DDPStrategy``'s arguments (nothing for plain DDP)."""
    return {} if method == "plain" else {"mode": method, "count_fn": token_mean.count_examples}


def ddp(method: str, **kwargs: Any) -> DDPStrategy:
    """``DDPStrategy(**kwargs)`` in Lightning's test, or the token-mean strategy with the same arguments."""
    return strategy_class(method)(**token_mean_kwargs(method), **kwargs)


def check_token_mean_ran(trainer: Trainer, method: str) -> None:
    """Ours, added after an in-process fit: the token-mean strategy normalized the windows (it did not fall back to
    plain DDP), and each window's N is its micro-batches (one row each)."""
    if method != "plain":
        window = trainer.strategy.last_window
        assert window is not None
        assert window.mode == method
        assert window.global_count == window.window_length


def mock_mps_count(monkeypatch: pytest.MonkeyPatch, n: int) -> None:  # tests/tests_pytorch/conftest.py
    monkeypatch.setattr(lightning.fabric.accelerators.mps, "_get_all_available_mps_gpus", lambda: [0] if n > 0 else [])
    monkeypatch.setattr(lightning.fabric.accelerators.mps.MPSAccelerator, "is_available", lambda *_: n > 0)


@pytest.fixture
def mps_count_0(monkeypatch: pytest.MonkeyPatch) -> None:  # tests/tests_pytorch/conftest.py
    mock_mps_count(monkeypatch, 0)


# ---------------------------------------------------------------------------------------------------------------------
# tests/tests_pytorch/strategies/test_ddp.py
# ---------------------------------------------------------------------------------------------------------------------


@method
@pytest.mark.parametrize(
    ("process_group_backend", "device_str", "expected_process_group_backend"),
    [
        pytest.param("foo", "cpu", "foo"),
        pytest.param("foo", "cuda:0", "foo"),
        pytest.param(None, "cuda:0", "nccl"),
        pytest.param(None, "cpu", "gloo"),
    ],
)
def test_ddp_process_group_backend(method, process_group_backend, device_str, expected_process_group_backend):
    """Test settings for process group backend."""

    class MockDDPStrategy(strategy_class(method)):  # type: ignore[misc]
        def __init__(self, root_device, process_group_backend):
            self._root_device = root_device
            super().__init__(process_group_backend=process_group_backend, **token_mean_kwargs(method))

        @property
        def root_device(self):
            return self._root_device

    strategy = MockDDPStrategy(process_group_backend=process_group_backend, root_device=torch.device(device_str))
    assert strategy._get_process_group_backend() == expected_process_group_backend


@pytest.mark.parametrize(
    ("strategy_name", "expected_ddp_kwargs"),
    [
        ("ddp_spawn", {}),
        ("ddp_fork", {}),
        ("ddp_notebook", {}),
        ("ddp_spawn_find_unused_parameters_false", {"find_unused_parameters": False}),
        ("ddp_spawn_find_unused_parameters_true", {"find_unused_parameters": True}),
        ("ddp_fork_find_unused_parameters_false", {"find_unused_parameters": False}),
        ("ddp_fork_find_unused_parameters_true", {"find_unused_parameters": True}),
        ("ddp_notebook_find_unused_parameters_false", {"find_unused_parameters": False}),
        ("ddp_notebook_find_unused_parameters_true", {"find_unused_parameters": True}),
        ("ddp", {}),
        ("ddp_find_unused_parameters_false", {"find_unused_parameters": False}),
        ("ddp_find_unused_parameters_true", {"find_unused_parameters": True}),
        # ours: the token-mean names, registered next to Lightning's, which must still give plain DDPStrategy
        ("ddp_token_mean", {}),
        ("ddp_token_mean_spawn", {}),
        ("ddp_token_mean_fork", {}),
    ],
)
def test_ddp_kwargs_from_registry(strategy_name, expected_ddp_kwargs, mps_count_0):
    trainer = Trainer(strategy=strategy_name)
    assert trainer.strategy._ddp_kwargs == expected_ddp_kwargs
    expected = TokenMeanDDPStrategy if "token_mean" in strategy_name else DDPStrategy  # ours
    assert type(trainer.strategy) is expected


@method
@mock.patch("torch.distributed.init_process_group")
def test_set_timeout(mock_init_process_group, method):
    """Test that the timeout gets passed to the ``torch.distributed.init_process_group`` function."""
    test_timedelta = timedelta(seconds=30)
    model = BoringModel()
    ddp_strategy = ddp(method, timeout=test_timedelta)
    trainer = Trainer(
        max_epochs=1,
        accelerator="cpu",
        strategy=ddp_strategy,
    )
    # test wrap the model if fitting
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()

    process_group_backend = trainer.strategy._get_process_group_backend()
    global_rank = trainer.strategy.cluster_environment.global_rank()
    world_size = trainer.strategy.cluster_environment.world_size()
    kwargs = {}
    if _TORCH_GREATER_EQUAL_2_3:
        kwargs["device_id"] = trainer.strategy.root_device if trainer.strategy.root_device.type != "cpu" else None
    mock_init_process_group.assert_called_with(
        process_group_backend, rank=global_rank, world_size=world_size, timeout=test_timedelta, **kwargs
    )


@method
@mock.patch("torch.distributed.init_process_group")
def test_device_id_passed_for_cuda_devices_pytorch(mock_init_process_group, method):
    """Test that device_id is passed to init_process_group for CUDA devices but not for CPU."""
    # Test with CPU device - device_id should be None
    model = BoringModel()
    ddp_strategy = ddp(method)
    trainer = Trainer(
        max_epochs=1,
        accelerator="cpu",
        strategy=ddp_strategy,
    )
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()

    process_group_backend = trainer.strategy._get_process_group_backend()
    global_rank = trainer.strategy.cluster_environment.global_rank()
    world_size = trainer.strategy.cluster_environment.world_size()
    kwargs = {}
    if _TORCH_GREATER_EQUAL_2_3:
        kwargs["device_id"] = trainer.strategy.root_device if trainer.strategy.root_device.type != "cpu" else None
    mock_init_process_group.assert_called_with(
        process_group_backend,
        rank=global_rank,
        world_size=world_size,
        timeout=trainer.strategy._timeout,
        **kwargs,
    )


@pytest.mark.distributed
@method
def test_ddp_configure_ddp(method, mps_count_0):
    """Tests with ddp strategy."""
    model = BoringModel()
    ddp_strategy = ddp(method)
    trainer = Trainer(
        max_epochs=1,
        strategy=ddp_strategy,
    )
    # test wrap the model if fitting
    trainer.state.fn = TrainerFn.FITTING
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()
    assert isinstance(trainer.model, LightningModule)
    trainer.strategy.setup(trainer)
    # in DDPStrategy configure_ddp(), model wrapped by DistributedDataParallel
    assert isinstance(trainer.model, DistributedDataParallel)

    ddp_strategy = ddp(method)
    trainer = Trainer(
        max_epochs=1,
        strategy=ddp_strategy,
    )
    # test do not wrap the model if TrainerFn is not fitting
    trainer.state.fn = TrainerFn.VALIDATING
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()
    trainer.strategy.setup(trainer)
    # in DDPStrategy configure_ddp(), model are still LightningModule
    assert isinstance(trainer.model, LightningModule)


# ---------------------------------------------------------------------------------------------------------------------
# tests/tests_pytorch/strategies/test_ddp_integration.py
# ---------------------------------------------------------------------------------------------------------------------


class UnusedParametersModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.intermediate_layer = torch.nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            batch = self.intermediate_layer(batch)
        return super().training_step(batch, batch_idx)


@pytest.mark.distributed
@method
def test_find_unused_parameters_ddp_spawn_raises(method):
    """Test that the DDP strategy can change PyTorch's error message so that it's more useful for Lightning users."""
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ddp(method, **FORK), max_steps=2, logger=False)
    with pytest.raises(
        ProcessRaisedException, match="It looks like your LightningModule has parameters that were not used in"
    ):
        trainer.fit(UnusedParametersModel())


@pytest.mark.distributed
@method
def test_find_unused_parameters_ddp_exception(method):
    """Test that the DDP strategy can change PyTorch's error message so that it's more useful for Lightning users."""
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ddp(method), max_steps=2, logger=False)
    with pytest.raises(RuntimeError, match="It looks like your LightningModule has parameters that were not used in"):
        trainer.fit(UnusedParametersModel())


class BoringCallbackDDPSpawnModel(BoringModel):
    def __init__(self, name: str, val: float):
        super().__init__()
        self.name = name
        self.val = val

    def validation_step(self, batch, batch_idx):
        self.log(self.name, self.val)
        return super().validation_step(batch, batch_idx)


class CustomMultiProcessingLauncher(_MultiProcessingLauncher):
    def get_extra_results(self, trainer):
        extra = super().get_extra_results(trainer)
        extra["test_val"] = "test_val"
        return extra

    def update_main_process_results(self, trainer, extra) -> None:
        trainer.strategy.test_val = extra.pop("test_val")
        return super().update_main_process_results(trainer, extra)


def spawn_strategy(method):
    """Lightning's ``TestDDPSpawnStrategy(DDPStrategy)``, deriving from the method's strategy class."""

    class TestDDPSpawnStrategy(strategy_class(method)):  # type: ignore[misc]
        def _configure_launcher(self):
            self._launcher = CustomMultiProcessingLauncher(self, **FORK)

    return TestDDPSpawnStrategy(**token_mean_kwargs(method))


@pytest.mark.distributed
@method
def test_ddp_spawn_add_get_queue(method, tmp_path):
    """Tests get_extra_results/update_main_process_results with DDPSpawnStrategy."""
    ddp_spawn_strategy = spawn_strategy(method)
    trainer = Trainer(
        default_root_dir=tmp_path, fast_dev_run=True, accelerator="cpu", devices=2, strategy=ddp_spawn_strategy
    )

    val: float = 1.0
    val_name: str = "val_acc"
    model = BoringCallbackDDPSpawnModel(val_name, val)
    dm = BoringDataModule()
    trainer.fit(model, datamodule=dm)
    assert trainer.callback_metrics[val_name] == torch.tensor(val)
    assert ddp_spawn_strategy.test_val == "test_val"


class BoringModelDDPCPU(BoringModel):
    def on_train_start(self) -> None:
        # make sure that the model is on CPU when training
        assert self.device == torch.device("cpu")


@pytest.mark.distributed
@method
def test_ddp_cpu(method):
    """Tests if device is set correctly when training for DDPStrategy."""
    trainer = Trainer(devices=2, strategy=ddp(method, **FORK), accelerator="cpu", fast_dev_run=True)
    # assert strategy attributes for device setting
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    model = BoringModelDDPCPU()
    trainer.fit(model)


@method
def test_configure_launcher_create_processes_externally(method):
    class MyClusterEnvironment(ClusterEnvironment):
        @property
        def creates_processes_externally(self):
            return True

        @property
        def main_address(self):
            return ""

        @property
        def main_port(self):
            return 8080

        @staticmethod
        def detect():
            return True

        def world_size(self):
            return 1

        def set_world_size(self):
            pass

        def global_rank(self):
            return 0

        def set_global_rank(self):
            pass

        def local_rank(self):
            return 0

        def node_rank(self):
            return 0

    ddp_strategy = ddp(method, cluster_environment=MyClusterEnvironment(), parallel_devices=[torch.device("cpu")])
    assert ddp_strategy.launcher is None
    ddp_strategy._configure_launcher()
    assert isinstance(ddp_strategy.launcher, _SubprocessScriptLauncher)

    ddp_strategy.launcher._call_children_scripts = Mock()
    launch_fn = Mock()
    ddp_strategy.launcher.launch(launch_fn)
    ddp_strategy.launcher._call_children_scripts.assert_not_called()
    launch_fn.assert_called_once()


@method
@mock.patch.dict(os.environ, {"LOCAL_RANK": "1"})
def test_incorrect_ddp_script_spawning(method, tmp_path):
    """Test an error message when user accidentally instructs Lightning to spawn children processes on rank > 0."""

    class WronglyImplementedEnvironment(LightningEnvironment):
        @property
        def creates_processes_externally(self):
            # returning false no matter what means Lightning would spawn also on ranks > 0 new processes
            return False

    model = BoringModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        strategy=ddp(method),
        accelerator="cpu",
        devices=2,
        plugins=[WronglyImplementedEnvironment()],
        barebones=True,
    )
    with pytest.raises(
        RuntimeError, match=r"Lightning attempted to launch new distributed processes with `local_rank > 0`."
    ):
        trainer.fit(model)


# ---------------------------------------------------------------------------------------------------------------------
# tests/tests_pytorch/strategies/launchers/test_multiprocessing.py
# ---------------------------------------------------------------------------------------------------------------------


@method
@pytest.mark.parametrize("trainer_fn", [TrainerFn.FITTING, "other"])
@pytest.mark.parametrize("fake_node_rank", [0, 1])
@pytest.mark.parametrize("fake_local_rank", [0, 1])
def test_collect_rank_zero_results(method, trainer_fn, fake_node_rank, fake_local_rank, tmp_path):
    """Tests that the spawn strategy transfers the new weights to the main process and deletes the temporary file."""
    model = Mock(wraps=BoringModel(), spec=BoringModel)
    fake_global_rank = 2 * fake_node_rank + fake_local_rank

    cluster_environment = Mock(spec=ClusterEnvironment)
    cluster_environment.world_size.return_value = 4
    cluster_environment.node_rank.return_value = fake_node_rank
    cluster_environment.local_rank.return_value = fake_local_rank
    cluster_environment.global_rank.return_value = fake_global_rank

    strategy = ddp(method, cluster_environment=cluster_environment, start_method="spawn")
    strategy._local_rank = fake_local_rank

    launcher = _MultiProcessingLauncher(strategy=strategy)
    trainer = Trainer(accelerator="cpu", default_root_dir=tmp_path, strategy=strategy)

    assert strategy.node_rank == fake_node_rank
    assert strategy.local_rank == fake_local_rank
    assert strategy.global_rank == fake_global_rank

    trainer.strategy.connect(model)
    trainer.state.fn = trainer_fn  # pretend we are in a particular trainer state

    spawn_output = launcher._collect_rank_zero_results(trainer, {})

    model.state_dict.assert_called_once()
    is_fitting = trainer_fn == TrainerFn.FITTING
    if strategy.local_rank == 0:
        # on local rank 0 (each node), we expect a temp checkpoint (when fitting)
        assert not is_fitting or spawn_output.weights_path.endswith(".temp.ckpt")
        assert not is_fitting or os.path.isfile(spawn_output.weights_path)
        assert is_fitting or spawn_output.weights_path is None
    else:
        # all other ranks don't have outputs (rank 0 needs to handle the output)
        assert spawn_output is None


@method
@pytest.mark.parametrize("trainer_fn", [TrainerFn.FITTING, "other"])
def test_transfer_weights(method, tmp_path, trainer_fn):
    """Tests that the multiprocessing launcher transfers the new weights to the main process and deletes the temporary
    file."""
    model = Mock(wraps=BoringModel(), spec=BoringModel)
    strategy = ddp(method, start_method="spawn")
    trainer = Trainer(accelerator="cpu", default_root_dir=tmp_path, strategy=strategy)
    trainer.strategy.connect(model)
    trainer.state.fn = trainer_fn  # pretend we are in a particular trainer state

    spawn_output = strategy._launcher._collect_rank_zero_results(trainer, {})

    model.state_dict.assert_called_once()
    if trainer_fn == TrainerFn.FITTING:
        assert spawn_output.weights_path.endswith(".temp.ckpt")
        assert os.path.isfile(spawn_output.weights_path)
    else:
        assert spawn_output.weights_path is None

    # <-- here would normally be the multiprocessing boundary
    strategy._launcher._recover_results_in_main_process(spawn_output, trainer)
    assert model.load_state_dict.call_count == int(spawn_output.weights_path is not None)


@method
def test_non_strict_loading(method, tmp_path):
    """Tests that the multiprocessing launcher loads the weights back into the main process but with strict loading
    disabled, not erroring for missing keys."""
    model = Mock(wraps=BoringModel(), spec=BoringModel)
    strategy = ddp(method, start_method="spawn")
    trainer = Trainer(accelerator="cpu", default_root_dir=tmp_path, strategy=strategy)
    trainer.strategy.connect(model)
    trainer.state.fn = TrainerFn.FITTING  # state dict loading only relevant for the FITTING case

    spawn_output = strategy._launcher._collect_rank_zero_results(trainer, {})
    # <-- here would normally be the multiprocessing boundary
    strategy._launcher._recover_results_in_main_process(spawn_output, trainer)
    model.load_state_dict.assert_called_once_with(ANY, strict=False)


class SimpleModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.tied_layer = torch.nn.Linear(32, 2)
        self.tied_layer.weight = self.layer.weight
        self.register_buffer("buffer", torch.ones(3))

    def on_fit_start(self) -> None:
        assert not self.layer.weight.is_shared()
        assert not self.tied_layer.weight.is_shared()
        assert not self.buffer.is_shared()

        # weights remain tied
        assert self.layer.weight.data_ptr() == self.tied_layer.weight.data_ptr()
        assert torch.equal(self.layer.weight.data, self.tied_layer.weight.data)


@pytest.mark.distributed
@method
def test_memory_sharing_disabled(method, tmp_path):
    """Test that the multiprocessing launcher disables memory sharing on model parameters and buffers to avoid race
    conditions on model updates."""
    model = SimpleModel()
    assert not model.layer.weight.is_shared()
    assert model.layer.weight.data_ptr() == model.tied_layer.weight.data_ptr()

    trainer = Trainer(
        default_root_dir=tmp_path, logger=False, accelerator="cpu", devices=2, strategy=ddp(method, **FORK),
        max_steps=0,
    )
    trainer.fit(model)


@pytest.mark.distributed
@method
def test_fit_twice_raises(method, mps_count_0):
    model = BoringModel()
    trainer = Trainer(
        limit_train_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        max_epochs=1,
        strategy=ddp(method, **FORK),
        barebones=True,
    )
    trainer.fit(model)
    trainer.test(model)  # make sure testing in between doesn't impact the result
    trainer.fit_loop.max_epochs += 1
    with pytest.raises(NotImplementedError, match=r"twice.*is not supported"):
        trainer.fit(model)


# ---------------------------------------------------------------------------------------------------------------------
# Gradient accumulation: tests/tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py,
# tests/tests_pytorch/trainer/test_trainer.py, tests/tests_pytorch/trainer/optimization/test_backward_calls.py,
# tests/tests_pytorch/loops/test_training_epoch_loop.py. Lightning runs them on one device without DDP; here the
# strategy is DDP on one CPU process, launched in this process (the popen launcher starts no child for one device),
# so that a mock of `zero_grad` or `backward` sees every call, and Lightning's batch counts stay as they are.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@method
@pytest.mark.parametrize("accumulate_grad_batches", [1, 2, 3])
def test_trainer_accumulate_grad_batches_zero_grad(method, tmp_path, accumulate_grad_batches):
    with mock.patch("torch.optim.SGD.zero_grad") as sgd_zero_grad:
        model = BoringModel()
        trainer = Trainer(
            default_root_dir=tmp_path,
            limit_train_batches=20,
            limit_val_batches=1,
            max_epochs=1,
            enable_model_summary=False,
            accumulate_grad_batches=accumulate_grad_batches,
            strategy=ddp(method),
        )
        assert trainer.accumulate_grad_batches == accumulate_grad_batches
        trainer.fit(model)
        assert sgd_zero_grad.call_count == math.ceil(trainer.limit_train_batches / accumulate_grad_batches)
        check_token_mean_ran(trainer, method)  # ours


@pytest.mark.distributed
@method
@pytest.mark.parametrize(
    ("accumulate_grad_batches", "expected_call_count"),
    [
        ({1: 2, 3: 4}, 10 + 5 + 5 + 3),
        ({0: 2, 2: 1}, 5 + 5 + 10 + 10),
    ],
)
def test_trainer_accumulate_grad_batches_with_callback(method, tmp_path, accumulate_grad_batches, expected_call_count):
    with mock.patch("torch.optim.SGD.zero_grad") as sgd_zero_grad:
        model = BoringModel()
        trainer = Trainer(
            default_root_dir=tmp_path,
            limit_train_batches=10,
            limit_val_batches=1,
            max_epochs=4,
            enable_model_summary=False,
            callbacks=GradientAccumulationScheduler(accumulate_grad_batches),
            strategy=ddp(method),
        )
        assert trainer.accumulate_grad_batches == 1  # initial value of Trainer argument
        trainer.fit(model)

        assert sum(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks) == 1
        assert sgd_zero_grad.call_count == expected_call_count
        check_token_mean_ran(trainer, method)  # ours


@pytest.mark.distributed
@method
def test_raises_when_accumulate_grad_batches_with_callback(method, tmp_path):
    """Test that it is not allowed to set both the Trainer argument and also pass a callback."""
    trainer = Trainer(
        default_root_dir=tmp_path, accumulate_grad_batches=2, callbacks=[GradientAccumulationScheduler({0: 2})],
        strategy=ddp(method),
    )
    with pytest.raises(ValueError, match="`accumulate_grad_batches` and are using the `GradientAccumulationScheduler`"):
        trainer.fit(BoringModel())


@pytest.mark.distributed
@method
@pytest.mark.parametrize(
    ("accumulate_grad_batches", "limit_train_batches"),
    [
        (3, 1.0),
        (3, 0.8),  # not to be divisible by accumulate_grad_batches on purpose
        (4, 1.0),
        (4, 0.7),  # not to be divisible by accumulate_grad_batches on purpose
    ],
)
def test_gradient_accumulation_scheduling_last_batch(method, tmp_path, accumulate_grad_batches, limit_train_batches):
    """Verify optimizer.step() applied to last batch while grad accumulation."""

    class TestModel(BoringModel):
        def state_dict(self, *args, **kwargs):
            return deepcopy(super().state_dict(*args, **kwargs))

        def check(self, d1, d2, equal=True):
            keys = d1.keys() | d2.keys()
            values = [torch.equal(d1[k], d2[k]) for k in keys]
            return all(values) if equal else not any(values)

        def backward(self, *args, **kwargs) -> None:
            pre_bwd_state_dict = self.state_dict()
            assert self.check(self.start_state_dict, pre_bwd_state_dict)

            out = super().backward(*args, **kwargs)

            # state dict is equal, just the gradients changed
            assert self.check(pre_bwd_state_dict, self.state_dict())

            return out

        def optimizer_step(self, *args, **kwargs):
            pre_opt_step_state_dict = self.state_dict()
            assert self.check(self.start_state_dict, pre_opt_step_state_dict)

            # this calls `backward` and `on_after_backward` inside the closure
            out = super().optimizer_step(*args, **kwargs)

            # the state dict changed
            assert self.check(pre_opt_step_state_dict, self.state_dict(), equal=False)

            self.opt_step_called = True
            return out

        def on_train_batch_start(self, *_):
            self.start_state_dict = self.state_dict()
            self.opt_step_called = False

        def on_train_batch_end(self, outputs, batch, batch_idx):
            end_state_dict = self.state_dict()
            is_last_batch = (batch_idx + 1) == self.trainer.num_training_batches

            if is_last_batch or self.opt_step_called:
                assert self.check(self.start_state_dict, end_state_dict, equal=False)
            else:
                assert self.check(self.start_state_dict, end_state_dict)

    model = TestModel()
    trainer = Trainer(
        accumulate_grad_batches=accumulate_grad_batches,
        max_epochs=2,
        limit_train_batches=limit_train_batches,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        strategy=ddp(method),
    )

    trainer.fit(model)
    check_token_mean_ran(trainer, method)  # ours


@pytest.mark.distributed
@method
def test_trainer_max_steps_accumulate_batches(method, tmp_path):
    """Verify model trains according to specified max steps with grad accumulated batches."""
    model = BoringModel()
    num_train_samples = math.floor(len(model.train_dataloader()) * 0.5)

    # define less train steps than epochs
    trainer = Trainer(
        limit_train_batches=0.5,
        default_root_dir=tmp_path,
        max_steps=num_train_samples + 10,
        accumulate_grad_batches=10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=ddp(method),
    )
    trainer.fit(model)

    assert trainer.state.finished, f"Training failed with {trainer.state}"
    assert trainer.global_step == trainer.max_steps, "Model did not stop at max_steps"
    check_token_mean_ran(trainer, method)  # ours


@pytest.mark.distributed
@method
@pytest.mark.parametrize("num_steps", [1, 2, 3])
@mock.patch("torch.Tensor.backward")
def test_backward_count_simple(torch_backward, num_steps, method):
    """Test that backward is called exactly once per step."""
    model = BoringModel()
    trainer = Trainer(max_steps=num_steps, logger=False, enable_checkpointing=False, strategy=ddp(method))
    trainer.fit(model)
    assert torch_backward.call_count == num_steps
    check_token_mean_ran(trainer, method)  # ours

    torch_backward.reset_mock()

    trainer.test(model)
    assert torch_backward.call_count == 0


@pytest.mark.distributed
@method
@mock.patch("torch.Tensor.backward")
def test_backward_count_with_grad_accumulation(torch_backward, method):
    """Test that backward is called the correct number of times when accumulating gradients."""
    model = BoringModel()
    trainer = Trainer(
        max_epochs=1, limit_train_batches=6, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        strategy=ddp(method),
    )
    trainer.fit(model)
    assert torch_backward.call_count == 6
    check_token_mean_ran(trainer, method)  # ours

    torch_backward.reset_mock()

    trainer = Trainer(max_steps=6, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                      strategy=ddp(method))
    trainer.fit(model)
    assert torch_backward.call_count == 12
    check_token_mean_ran(trainer, method)  # ours


REFUSED = (
    "TokenMeanDDPStrategy refuses torch.optim.LBFGS at fit start (ValueError from token_mean.strategy.check_fit, as"
    " documented): LBFGS re-evaluates the closure within one step, so the window's micro-batch would run (and be"
    " counted) again"
)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "method",
    [
        m if m == "plain" else pytest.param(m, marks=pytest.mark.xfail(raises=ValueError, strict=True, reason=REFUSED))
        for m in METHODS
    ],
)
@mock.patch("torch.Tensor.backward")
def test_backward_count_with_closure(torch_backward, method, tmp_path):
    """Using a closure (e.g. with LBFGS) should lead to no extra backward calls."""

    class TestModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    model = TestModel()
    trainer = Trainer(max_steps=5, logger=False, enable_checkpointing=False, strategy=ddp(method))
    trainer.fit(model)
    assert torch_backward.call_count == 5

    torch_backward.reset_mock()

    trainer = Trainer(max_steps=5, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                      strategy=ddp(method))
    trainer.fit(model)
    assert torch_backward.call_count == 10


@pytest.mark.distributed
@method
def test_no_batch_idx_gradient_accumulation(method):
    """Regression test for an issue where excluding the batch_idx from training_step would disable gradient
    accumulation."""

    class MyModel(BoringModel):
        last_batch_idx = -1

        def training_step(self, batch):  # no batch_idx
            return self.step(batch)

        def optimizer_step(self, epoch, batch_idx, *args, **kwargs):
            assert batch_idx in (1, 3)
            self.last_batch_idx = batch_idx
            return super().optimizer_step(epoch, batch_idx, *args, **kwargs)

    trainer = Trainer(fast_dev_run=4, accumulate_grad_batches=2, limit_val_batches=0, strategy=ddp(method))
    model = MyModel()
    trainer.fit(model)
    assert model.last_batch_idx == 3
    check_token_mean_ran(trainer, method)  # ours


# ---------------------------------------------------------------------------------------------------------------------
# Ours (not from Lightning): plain and token-mean DDP train BoringModel to the same parameters
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("accumulate_grad_batches", [1, 3])
def test_token_mean_trains_like_plain_ddp(tmp_path, accumulate_grad_batches):
    """With one row per micro-batch and full windows (24 batches), N = K and each micro-batch's loss is scaled by 1/K,
    as Lightning scales it: both modes end where plain DDP does. (A partial last window would differ on purpose: the
    token mean divides it by its own N, Lightning by K.)"""
    params = {}
    for method in METHODS:
        pl.seed_everything(7)
        model = BoringModel()
        trainer = Trainer(
            default_root_dir=tmp_path / method, max_epochs=2, limit_train_batches=24, limit_val_batches=0,
            accumulate_grad_batches=accumulate_grad_batches, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, strategy=ddp(method),
        )
        trainer.fit(model)
        assert trainer.global_step == 2 * 24 // accumulate_grad_batches
        check_token_mean_ran(trainer, method)
        params[method] = [p.detach().clone() for p in model.parameters()]
    for method in ("lookahead", "deferred"):
        for got, expected in zip(params[method], params["plain"], strict=True):
            torch.testing.assert_close(got, expected)
