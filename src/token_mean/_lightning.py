"""Every touch of Lightning's private internals, each with the Lightning (2.6) behaviour it relies on.

A Lightning upgrade has this one file to check. Public hooks live in the strategies; what is here has no public way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from token_mean._epoch import Epoch, Passes, length_is_a_hint
from token_mean._reader import Reader


def batch_position(trainer: pl.Trainer) -> int:
    """The position of the batch being trained (or started) in its epoch.

    Relies on: the epoch loop increments ``batch_progress.current.ready`` before ``on_train_batch_start`` and
    ``training_step``.
    """
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready) - 1


def steps_after_this_batch(trainer: pl.Trainer) -> bool:
    """Whether Lightning steps the optimizer after the batch being trained (tests and benchmarks ask it too).

    Relies on: ``_TrainingEpochLoop._should_accumulate()`` is the stepping rule (K reached, or the epoch's last batch).
    """
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def skips_backward(trainer: pl.Trainer) -> bool:
    """Whether the fit loop runs forward passes only this epoch (``StochasticWeightAveraging``'s BatchNorm epoch).

    Relies on: ``FitLoop._skip_backward`` (``_AutomaticOptimization._skip_backward``): the closure then runs
    ``training_step`` without zeroing or back-propagating, and the optimizer still steps at the epoch's last batch.
    """
    return bool(trainer.fit_loop._skip_backward)


def refuse_early_epoch_end(module: pl.LightningModule,
                           refusal: Callable[[int], Exception | None]) -> Callable[[], None]:
    """Make ``on_train_batch_start`` returning -1 raise ``refusal(batch_idx)`` (unless None) on the rank that
    returned it, before the loop leaves the epoch there; returns what undoes it.

    Relies on: the epoch loop calls the module's hook through ``getattr(pl_module, "on_train_batch_start")``
    (``call._call_lightning_module_hook``), so an instance attribute wraps it for this fit, and ends the epoch on a
    return value of -1 (``_TrainingEpochLoop.advance``).
    """
    hook = type(module).on_train_batch_start
    if hook is pl.LightningModule.on_train_batch_start:
        return lambda: None

    def wrapped(batch: Any, batch_idx: int, *args: Any) -> Any:
        response = hook(module, batch, batch_idx, *args)
        error = refusal(batch_idx) if response == -1 else None
        if error is not None:
            raise error
        return response

    module.on_train_batch_start = wrapped  # type: ignore[method-assign]
    return lambda: module.__dict__.pop("on_train_batch_start", None)


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning logs the step metrics of the batch being trained (in ``on_train_batch_end``).

    Relies on: ``_LoggerConnector.should_update_logs`` (``log_every_n_steps`` over the steps taken, or ``should_stop``).
    """
    return bool(trainer._logger_connector.should_update_logs)


def epoch_position(trainer: pl.Trainer) -> int:
    """Batches of this epoch Lightning has already taken: 0 at an epoch's start, more on a mid-epoch resume."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def uses_dataloader_iter(trainer: pl.Trainer) -> bool:
    """Relies on: ``training_step(self, dataloader_iter)`` makes the fit loop use ``_DataLoaderIterDataFetcher``."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    module = trainer.lightning_module
    return is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)


def follow(trainer: pl.Trainer, epoch: Epoch) -> None:
    """Make Lightning's fetcher end the epoch where ``epoch`` ends (a stream's end moves window by window).

    Relies on: ``_DataFetcher.done`` is ``fetched >= length`` for a loader with a length (the fetcher takes the
    reader's length from ``len()`` at ``iter()``, so it never prefetches), the epoch loop copies it into
    ``batch_progress.is_last_batch`` after each fetch, and both the stepping rule and the loop's end read
    ``is_last_batch``.
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or fetcher.length == epoch.length:
        return
    fetcher.length = epoch.length
    fetcher.done = fetcher.fetched >= epoch.length
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done


def set_loader_states_to_load(trainer: pl.Trainer, states: list[dict[str, Any]]) -> None:
    """On resume, load this rank's own loader state instead of rank 0's.

    Relies on: ``FitLoop.load_state_dict`` stores the checkpoint's loader states in ``_combined_loader_states_to_load``
    (rank 0's, on every rank) and ``setup_data`` loads them into the loaders, after the strategy restored its state.
    """
    trainer.fit_loop._combined_loader_states_to_load = states


def has_loader_states_to_load(trainer: pl.Trainer) -> bool:
    """Whether the checkpoint being resumed holds loader positions (a mid-epoch checkpoint of stateful loaders)."""
    return bool(trainer.fit_loop._combined_loader_states_to_load)


def checkpoint_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The loader states a checkpoint will hand the fit loop on resume (rank 0's), or None when it holds none.

    Relies on: ``FitLoop.on_save_checkpoint`` stores them as ``checkpoint["loops"]["fit_loop"]["state_dict"]
    ["combined_loader"]`` and ``FitLoop.on_load_checkpoint`` reads them from there during ``restore_loops``. For
    strategies that restore after setup (``ModelParallelStrategy``), ``strategy.load_checkpoint`` returns this dict
    before the loops are restored, so replacing the entry there is the way to give each rank its own position.
    """
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = fit_state.get("combined_loader")
    return states if states else None


def replace_checkpoint_loader_states(checkpoint: dict[str, Any], states: list[dict[str, Any]]) -> None:
    """Make the fit loop resume this rank's loaders from ``states`` (see :func:`checkpoint_loader_states`)."""
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = states


def resize_epoch(trainer: pl.Trainer, length: int | None) -> None:
    """Make Lightning's epoch ``length`` batches long (None: unsized), as every rank agreed.

    Relies on: ``FitLoop.setup_data`` sets ``max_batches`` (``trainer.num_training_batches``) from ``len()`` of the
    combined loader and, for a float ``val_check_interval``, ``val_check_batch = max(1, int(max_batches *
    val_check_interval))`` (``inf`` for an unsized loader with interval 1.0); both drive the stepping rule and
    validation, so they must agree across ranks.
    """
    fit_loop = trainer.fit_loop
    fit_loop.max_batches = float("inf") if length is None else length
    interval = trainer.val_check_interval
    if isinstance(interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
        if length is not None:
            trainer.val_check_batch = max(1, int(length * interval))
        elif interval == 1.0:
            trainer.val_check_batch = float("inf")


def read_through(trainer: pl.Trainer, passes: Passes) -> None:
    """Route the fit loop's training batches through ``passes`` from now on, for every (re)loaded loader: the ranks
    agree on the length when the loaders are set up, and each ``iter()`` begins a pass.

    Relies on: ``FitLoop.setup_data`` builds the ``CombinedLoader`` (after ``strategy.process_dataloader`` of each
    sub-loader), sets ``max_batches`` from its length (after ``limit_train_batches``), creates ``_data_fetcher`` and
    calls ``iter()`` on it (which prefetches one batch of an unsized loader); later epochs call ``iter(data_fetcher)``
    again; the fetcher reads batches with ``next(combined_loader)`` and sets its ``length`` from
    ``len(combined_loader)`` on ``iter``. User code's ``trainer.train_dataloader`` is the loaders themselves, so
    iterating it does not pass through the reader.
    """
    fit_loop = trainer.fit_loop
    fit_loop._token_mean_passes = passes  # type: ignore[attr-defined]  # a later fit's strategy brings its own
    if getattr(fit_loop, "_token_mean_read_through", False):
        return
    setup_data = fit_loop.setup_data

    def setup_data_through_reader() -> None:
        setup_data()
        combined = fit_loop._combined_loader
        if combined is None or isinstance(combined, _ReadCombinedLoader) or fit_loop._data_fetcher is None:
            return
        fetcher = fit_loop._data_fetcher
        hint = length_is_a_hint(combined.flattened)
        local = None if hint or fit_loop.max_batches == float("inf") else int(fit_loop.max_batches)
        own = None if hint else _own_length(combined)
        passes: Passes = fit_loop._token_mean_passes  # type: ignore[attr-defined]
        resize_epoch(trainer, passes.agree(local, own))
        prefetched = [*getattr(fetcher, "batches", [])]
        stateful = bool(CombinedLoader._state_dicts(combined))
        reader = Reader(
            lambda: CombinedLoader.__next__(combined),
            (lambda: CombinedLoader._state_dicts(combined)) if stateful else None,
            lambda: epoch_position(trainer),
        )
        reader.adopt(prefetched)
        combined.__class__ = _ReadCombinedLoader
        combined._token_mean_reader = reader  # type: ignore[attr-defined]
        combined._token_mean_begin = lambda: passes.begin(reader, trainer.current_epoch)  # type: ignore[attr-defined]
        combined._token_mean_reuse = True  # type: ignore[attr-defined]
        iter(fetcher)  # restarts the fetcher on the reader, keeping the loaders' iterators already started

    fit_loop.setup_data = setup_data_through_reader  # type: ignore[method-assign]
    fit_loop._token_mean_read_through = True  # type: ignore[attr-defined]


def _own_length(combined: CombinedLoader) -> int | None:
    """The combined loader's length without ``limit_train_batches``.

    Relies on: ``FitLoop.setup_data`` sets ``CombinedLoader.limits`` from ``limit_train_batches`` (for every limit,
    1.0 included) and calls ``iter()`` on it; ``len()`` of the combined loader is that of its mode's iterator
    (``_iterator``), which takes its own ``limits`` into account.
    """
    iterator = combined._iterator
    if iterator is None:
        return sized_len(combined)
    limits, iterator.limits = iterator.limits, None
    try:
        return sized_len(iterator)
    finally:
        iterator.limits = limits


class _ReadCombinedLoader(CombinedLoader):
    """Lightning's ``CombinedLoader`` whose batches come through the pass :class:`Passes` begins at each iter."""

    _token_mean_reader: Reader
    _token_mean_begin: Callable[[], Epoch]
    _token_mean_epoch: Epoch
    _token_mean_reuse: bool

    def __iter__(self) -> _ReadCombinedLoader:
        if self._token_mean_reuse:  # installed after Lightning's own iter(): keep its loader iterators
            self._token_mean_reuse = False
        else:
            super().__iter__()
        self._token_mean_epoch = self._token_mean_begin()
        return self

    def __next__(self) -> Any:
        return self._token_mean_epoch.next_item()

    def __len__(self) -> int:
        return self._token_mean_epoch.length

    def _state_dicts(self) -> list[dict[str, Any]]:
        reader = self._token_mean_reader
        return reader.consumed_state() if reader.stateful else []  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------------
# Lightning Fabric
# ---------------------------------------------------------------------------------------------------------------


def fabric_modules(model: Any) -> tuple[Any, Any] | None:
    """``(forward module, original module)`` of what ``fabric.setup`` returned (None for anything else).

    Relies on: ``fabric.setup`` returns a ``_FabricModule`` (inside a ``torch.compile`` wrapper when the model was
    compiled first) whose ``_forward_module`` is what the strategy made of the model (``DistributedDataParallel``, the
    FSDP2-sharded module itself) and whose ``_original_module`` is the user's module; ``_unwrap_compiled`` removes the
    compile wrapper.
    """
    from lightning.fabric.wrappers import _FabricModule, _unwrap_compiled

    wrapper, _ = _unwrap_compiled(model)
    if not isinstance(wrapper, _FabricModule):
        return None
    forward, _ = _unwrap_compiled(wrapper._forward_module)
    return forward, wrapper._original_module


def fabric_host_batches(loader: Any) -> tuple[Iterable[Any], Callable[[Any], Any]] | None:
    """For a loader from ``fabric.setup_dataloaders`` that moves batches to a device: one pass over its host batches
    and what moves one of them (None for any other iterable, or a loader that leaves batches where they are).

    Relies on: ``_FabricDataLoader.__iter__`` calls ``_set_sampler_epoch(_dataloader, _num_iter_calls)``, increments
    ``_num_iter_calls``, and yields ``move_data_to_device(item, _device)`` for each item of ``_dataloader`` when
    ``_device`` is set.
    """
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.fabric.wrappers import _FabricDataLoader

    if not isinstance(loader, _FabricDataLoader) or loader._device is None:
        return None
    _set_sampler_epoch(loader._dataloader, loader._num_iter_calls)
    loader._num_iter_calls += 1
    device = loader._device
    return loader._dataloader, lambda batch: move_data_to_device(batch, device)


def fabric_loader_pass(loader: Any, restore: int | None) -> int | None:
    """The pass counter of a loader from ``fabric.setup_dataloaders`` as its next ``iter()`` will use it (the epoch
    its sampler orders by), first set to ``restore`` when given; None for any other iterable.

    Relies on: ``_FabricDataLoader.__iter__`` calls ``_set_sampler_epoch(_dataloader, _num_iter_calls)`` and then
    increments ``_num_iter_calls``, which starts at 0 with the loader (a ``set_epoch`` of the user's is overwritten).
    """
    from lightning.fabric.wrappers import _FabricDataLoader

    if not isinstance(loader, _FabricDataLoader):
        return None
    if restore is not None:
        loader._num_iter_calls = restore
    return int(loader._num_iter_calls)


def fabric_strategy_of(model: Any) -> Any:
    """The strategy that set up ``model`` (a ``_FabricModule``'s ``_strategy``)."""
    from lightning.fabric.wrappers import _unwrap_compiled

    return getattr(_unwrap_compiled(model)[0], "_strategy", None)


def show_on_progress_bar(trainer: pl.Trainer, values: dict[str, float]) -> None:
    """Put host floats on the progress bar, on this rank, without a tensor or a host read.

    Relies on: ``trainer.progress_bar_metrics`` returns the logger connector's own dict (``_progress_bar_metrics``),
    which Lightning only updates (with ``self.log(..., prog_bar=True)`` values) during a fit and clears at its start
    (``reset_metrics``); the progress bars read it at each refresh and take floats as they are.
    """
    trainer.progress_bar_metrics.update(values)


__all__ = [
    "batch_position",
    "checkpoint_loader_states",
    "epoch_position",
    "fabric_host_batches",
    "fabric_loader_pass",
    "fabric_modules",
    "fabric_strategy_of",
    "follow",
    "has_loader_states_to_load",
    "read_through",
    "refuse_early_epoch_end",
    "replace_checkpoint_loader_states",
    "resize_epoch",
    "set_loader_states_to_load",
    "should_update_logs",
    "show_on_progress_bar",
    "skips_backward",
    "steps_after_this_batch",
    "uses_dataloader_iter",
]
