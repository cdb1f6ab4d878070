"""Every touch of Lightning's private internals (what has no public hook), each with the Lightning (2.6) behaviour
it relies on: a Lightning upgrade has this one file to check. Checked by the suite on Lightning 2.6.0 and 2.6.6."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from token_mean._epoch import Epoch, Passes, length_is_a_hint
from token_mean._reader import Reader


def batch_position(trainer: pl.Trainer) -> int:
    """The position in its epoch of the batch being trained (or started). Relies on: the epoch loop increments
    ``batch_progress.current.ready`` before the batch's hooks and step."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready) - 1


def steps_after_this_batch(trainer: pl.Trainer) -> bool:
    """Whether Lightning steps the optimizer after the batch being trained. Relies on:
    ``_TrainingEpochLoop._should_accumulate()`` is the stepping rule (K reached, or the epoch's end)."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def skips_backward(trainer: pl.Trainer) -> bool:
    """Whether the fit loop runs forward passes only this epoch (``StochasticWeightAveraging``'s BatchNorm epoch).
    Relies on: under ``FitLoop._skip_backward`` the closure runs ``training_step`` without zeroing or backward, and
    the optimizer still steps at the epoch's last batch."""
    return bool(trainer.fit_loop._skip_backward)


def refuse_early_epoch_end(
    module: pl.LightningModule, refusal: Callable[[int], Exception | None]
) -> Callable[[], None]:
    """Make ``on_train_batch_start`` returning -1 raise ``refusal(batch_idx)`` (unless None) on that rank, before the
    loop leaves the epoch; returns what undoes it. Relies on: ``call._call_lightning_module_hook`` looks the hook up
    with ``getattr`` (an instance attribute wraps it); ``_TrainingEpochLoop.advance`` ends the epoch on -1."""
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


def sizes_the_training_loader(trainer: pl.Trainer | None) -> bool:
    """Whether ``Strategy.process_dataloader`` is called for a training loader of the fit (of ``trainer``). Relies on:
    ``FitLoop.setup_data`` calls it (in ``_process_dataloader``) for each training loader while ``trainer.training``
    (the evaluation loops set ``validating`` or ``sanity_checking`` first), before ``has_len_all_ranks``, whose
    ``strategy.reduce`` only the ranks with a sized loader join and which raises alone on a rank of length 0."""
    return trainer is not None and bool(trainer.training)


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning logs the step metrics of the batch being trained. Relies on:
    ``_LoggerConnector.should_update_logs`` (``log_every_n_steps`` over steps taken, or ``should_stop``)."""
    return bool(trainer._logger_connector.should_update_logs)


def epoch_position(trainer: pl.Trainer) -> int:
    """Batches of this epoch Lightning has already taken: 0 at an epoch's start, more on a mid-epoch resume."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def uses_dataloader_iter(trainer: pl.Trainer) -> bool:
    """Relies on: ``training_step(self, dataloader_iter)`` makes the fit loop use ``_DataLoaderIterDataFetcher``."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    module = trainer.lightning_module
    return is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)


def end_epoch_with(trainer: pl.Trainer, epoch: Epoch) -> None:
    """Tell the loop whether the batch being trained is the epoch's last, where ``epoch``'s end moved (a stream's end
    is agreed at a window's end, after the loop fetched the window's last batch). Relies on: the epoch loop copies the
    fetcher's ``done`` into ``batch_progress.is_last_batch`` as it fetches a batch, and reads it after the batch's
    step (validation at the epoch's end, the loop's end)."""
    fetcher = trainer.fit_loop._data_fetcher
    done = fetcher.follow(epoch) if isinstance(fetcher, _PassFetcher) else None
    if done is not None:
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = done


def load_own_loader_states(trainer: pl.Trainer, restore: Callable[[bool], list[dict[str, Any]] | None]) -> None:
    """On resume, load this rank's own loader states, ``restore(whether the checkpoint holds loader states)``, instead
    of rank 0's. Relies on: ``FitLoop.load_state_dict`` puts rank 0's in ``_combined_loader_states_to_load``, which
    ``setup_data`` loads after the strategy's restore."""
    own = restore(bool(trainer.fit_loop._combined_loader_states_to_load))
    if own is not None:
        trainer.fit_loop._combined_loader_states_to_load = own


def replace_checkpoint_loader_states(
    checkpoint: dict[str, Any], restore: Callable[[bool], list[dict[str, Any]] | None]
) -> None:
    """Make the fit loop resume this rank's loaders from ``restore(whether the checkpoint holds loader states)``
    instead of rank 0's. Relies on: ``FitLoop`` keeps them at
    ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``; a strategy restoring after setup
    (``ModelParallelStrategy``) returns this dict from ``load_checkpoint`` before ``restore_loops``."""
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    own = restore(bool(fit_state.get("combined_loader")))
    if own is not None:
        fit_state["combined_loader"] = own


def resize_epoch(trainer: pl.Trainer, length: int | None) -> None:
    """Make Lightning's epoch ``length`` batches long (None: unsized), as every rank agreed. Relies on:
    ``FitLoop.setup_data`` sets ``max_batches`` from the loader's ``len()`` and, for a float ``val_check_interval``,
    ``val_check_batch = max(1, int(max_batches * val_check_interval))`` (``inf`` if unsized, interval 1.0); both
    drive the stepping rule and validation."""
    fit_loop = trainer.fit_loop
    fit_loop.max_batches = float("inf") if length is None else length
    interval = trainer.val_check_interval
    if isinstance(interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
        if length is not None:
            trainer.val_check_batch = max(1, int(length * interval))
        elif interval == 1.0:
            trainer.val_check_batch = float("inf")


def read_through(trainer: pl.Trainer, passes: Passes) -> None:
    """Route the fit loop's training batches through ``passes`` for every (re)loaded loader: the ranks agree on the
    length at setup, and a :class:`_PassFetcher` takes the place of Lightning's fetcher (``trainer.train_dataloader``
    itself bypasses it). Relies on: ``FitLoop.setup_data`` builds the ``CombinedLoader``, sets ``max_batches`` from its
    length (after ``limit_train_batches``), creates ``_data_fetcher`` and calls ``iter()`` on it (a
    ``_PrefetchDataFetcher``: an unsized loader's first batch prefetched into ``batches``); the loops use
    ``_data_fetcher`` as :class:`_PassFetcher` says; ``FitLoop.state_dict`` saves
    ``_combined_loader._state_dicts()``."""
    fit_loop = trainer.fit_loop
    fit_loop._token_mean_passes = passes  # type: ignore[attr-defined]  # a later fit's strategy brings its own
    if getattr(fit_loop, "_token_mean_read_through", False):
        return
    setup_data = fit_loop.setup_data

    def setup_data_through_reader() -> None:
        setup_data()
        combined, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
        if combined is None or fetcher is None or isinstance(fetcher, _PassFetcher):
            return
        hint = length_is_a_hint(combined.flattened)
        local = None if hint or fit_loop.max_batches == float("inf") else int(fit_loop.max_batches)
        own = None if hint else _own_length(combined)
        passes: Passes = fit_loop._token_mean_passes  # type: ignore[attr-defined]
        resize_epoch(trainer, passes.agree(local, own))
        stateful = bool(combined._state_dicts())
        reader = Reader(
            combined.__next__,
            (lambda: CombinedLoader._state_dicts(combined)) if stateful else None,
            lambda: epoch_position(trainer),
        )
        reader.adopt([*getattr(fetcher, "batches", [])])
        if stateful:  # a checkpoint keeps the loaders' state after the batches handed out, not after those read ahead
            combined._state_dicts = reader.consumed_state  # type: ignore[method-assign]
        fit_loop._data_fetcher = _PassFetcher(combined, lambda: passes.begin(reader, trainer.current_epoch))
        iter(fit_loop._data_fetcher)  # the first pass, over the loaders' iterators Lightning's `iter()` started

    fit_loop.setup_data = setup_data_through_reader  # type: ignore[method-assign]
    fit_loop._token_mean_read_through = True  # type: ignore[attr-defined]


def _own_length(combined: CombinedLoader) -> int | None:
    """The combined loader's length without ``limit_train_batches``. Relies on: ``setup_data`` sets its ``limits``
    (1.0 included) and calls ``iter()``; its ``len()`` is its ``_iterator``'s, which applies its own ``limits``."""
    iterator = combined._iterator
    if iterator is None:
        return sized_len(combined)
    limits, iterator.limits = iterator.limits, None
    try:
        return sized_len(iterator)
    finally:
        iterator.limits = limits


class _PassFetcher(_DataFetcher):
    """Lightning's fetcher over the fit's passes: each ``iter()`` begins one (restarting the loaders after the
    first), and the epoch is as long as the pass (a stream's end moves window by window: :meth:`follow`). Relies on:
    ``_DataFetcher.__next__`` reads ``next(iterator)``, counts ``fetched`` and sets ``done`` from ``length``; the epoch
    loop calls ``iter(data_fetcher)`` at a later epoch's start and adds a resumed epoch's trained batches to
    ``fetched``."""

    def __init__(self, combined: CombinedLoader, begin: Callable[[], Epoch]) -> None:
        super().__init__()
        self.setup(combined)
        self._begin = begin
        self._restart = False  # the first pass reads the iterators Lightning's own `iter()` started

    def __iter__(self) -> _PassFetcher:
        if self._restart:
            iter(self.combined_loader)
        self._restart = True
        epoch = self._begin()
        self.iterator = iter(epoch.next_item, None)  # items are tuples, never None; StopIteration ends it
        self.fetched, self.length = 0, epoch.length
        self.done = self.length == 0
        return self

    def follow(self, epoch: Epoch) -> bool | None:
        """Whether the batch fetched last is the pass's last, where the pass's end moved since (else None)."""
        if self.length == epoch.length:
            return None
        self.length = epoch.length
        self.done = self.fetched >= epoch.length
        return self.done


# ---- Lightning Fabric ----


def fabric_modules(model: Any) -> tuple[Any, Any] | None:
    """``(forward module, original module)`` of what ``fabric.setup`` returned (None for anything else). Relies on:
    ``fabric.setup`` returns a ``_FabricModule`` (possibly compiled: ``_unwrap_compiled`` unwraps it) whose
    ``_forward_module`` is the strategy's wrapped model and ``_original_module`` the user's."""
    from lightning.fabric.wrappers import _FabricModule, _unwrap_compiled

    wrapper, _ = _unwrap_compiled(model)
    if not isinstance(wrapper, _FabricModule):
        return None
    forward, _ = _unwrap_compiled(wrapper._forward_module)
    return forward, wrapper._original_module


def fabric_host_batches(loader: Any) -> tuple[Iterable[Any], Callable[[Any], Any]] | None:
    """For a ``fabric.setup_dataloaders`` loader that moves batches to a device: one pass over its host batches and
    what moves one (None for anything else). Relies on: ``_FabricDataLoader.__iter__`` sets the sampler epoch to
    ``_num_iter_calls``, increments it and, with ``_device`` set, yields ``move_data_to_device(item, _device)``."""
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
    """The pass counter (sampler epoch) the next ``iter()`` of a ``fabric.setup_dataloaders`` loader uses, first set
    to ``restore`` when given; None for anything else. Relies on: ``_FabricDataLoader.__iter__`` sets the sampler
    epoch to ``_num_iter_calls`` (from 0, overriding a user's ``set_epoch``), then increments it."""
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
    """Put host floats on this rank's progress bar, without a tensor or a host read. Relies on:
    ``trainer.progress_bar_metrics`` is the logger connector's ``_progress_bar_metrics``, only updated during a fit
    and cleared at its start; the progress bars read it at each refresh and take floats as they are."""
    trainer.progress_bar_metrics.update(values)


def refuse_static_graph(strategy: Any, name: str, argument: str, accumulate: int) -> None:
    """Refuse K > 1 where a DDP strategy (the Trainer's or Fabric's) wraps its model with ``static_graph=True``.
    Relies on: ``DDPStrategy`` keeps the arguments it hands to ``DistributedDataParallel`` in ``_ddp_kwargs``."""
    if accumulate > 1 and (getattr(strategy, "_ddp_kwargs", None) or {}).get("static_graph"):
        raise ValueError(
            f"`{name}` cannot accumulate ({argument}={accumulate}) with DDP's `static_graph=True`: a static graph"
            " expects every backward to reduce the gradients, and accumulation reduces them in each window's last"
            " backward only (plain DDP fails too, with PyTorch's 'expect_autograd_hooks_ INTERNAL ASSERT FAILED')."
            " Remove `static_graph=True`."
        )


def replay_training_step(module: Any, batch: Any, index: int) -> Any:
    """What ``module.training_step(batch, index)`` returns, its ``self.log`` calls dropped (the run's logged metrics
    stay as they were). Relies on: instance attributes shadow the methods, and Lightning passes ``batch_idx`` only
    to a step that takes it (``is_param_in_hook_signature``)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    step = module.training_step
    args: tuple[Any, ...] = (batch, index) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)
    module.log, module.log_dict = _ignore, _ignore
    try:
        return step(*args)
    finally:
        del module.log, module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
