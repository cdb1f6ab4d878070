"""Exact global token-mean gradients for Lightning data parallelism with gradient accumulation.

``TokenMeanDDPStrategy`` and ``TokenMeanModelParallelStrategy`` (FSDP2 × TP), both ``TokenMeanStrategy``, and
``token_mean.fabric.TokenMeanAccumulator`` (a Fabric loop) normalize each step by its valid items over all ranks and
micro-batches. ``DenominatorMonitor`` logs each step's N and flags divergence from a reference; ``TokenMeanLoss`` and
``ExactDistributedSampler`` make validation exact; the named counts (``count_valid_labels``, ...) set the objective.
"""

from importlib import metadata as _metadata

from token_mean import _versions  # noqa: F401  (first: refuses a torch, Lightning or torchmetrics older than tested)

# isort: split
from token_mean import _audit  # noqa: F401  (a layer: importing it registers the count check with the front ends)
from token_mean._counts import (
    IGNORE_INDEX,
    ClassWeightedCount,
    count_examples,
    count_micro_batches,
    count_sequences,
    count_shifted_labels,
    count_valid_labels,
    sequence_token_means,
    sequence_token_sums,
)
from token_mean._monitor import OnDivergence
from token_mean._settings import CountFn, LossReduction, Mode
from token_mean._window import in_filler_batch
from token_mean.callback import DenominatorMonitor
from token_mean.errors import AuditError, DenominatorError, DivergenceError
from token_mean.metrics import TokenMeanLoss
from token_mean.model_parallel import TokenMeanModelParallelStrategy
from token_mean.results import Audit, Divergence, WindowStats
from token_mean.sampler import ExactDistributedSampler
from token_mean.strategy import TokenMeanDDPStrategy, TokenMeanStrategy

try:
    # pyproject.toml's `version` is the one source; the installed distribution's metadata carries it
    __version__ = _metadata.version("lightning-token-mean")
except _metadata.PackageNotFoundError:  # a source tree on the path, never installed
    __version__ = "0+unknown"

__all__ = [
    "IGNORE_INDEX",
    "Audit",
    "AuditError",
    "ClassWeightedCount",
    "CountFn",
    "DenominatorError",
    "DenominatorMonitor",
    "Divergence",
    "DivergenceError",
    "ExactDistributedSampler",
    "LossReduction",
    "Mode",
    "OnDivergence",
    "TokenMeanDDPStrategy",
    "TokenMeanLoss",
    "TokenMeanModelParallelStrategy",
    "TokenMeanStrategy",
    "WindowStats",
    "count_examples",
    "count_micro_batches",
    "count_sequences",
    "count_shifted_labels",
    "count_valid_labels",
    "in_filler_batch",
    "sequence_token_means",
    "sequence_token_sums",
]
