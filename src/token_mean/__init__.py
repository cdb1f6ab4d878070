"""Exact global token-mean gradients for Lightning DDP with gradient accumulation.

``TokenMeanDDPStrategy`` makes each optimizer step follow the mean loss over all valid items of the step (all ranks,
all micro-batches); ``DenominatorMonitor`` logs the denominator each step used and flags divergence from a reference
run; ``TokenMeanLoss`` is the exact token-weighted validation loss; ``ExactDistributedSampler`` shards without
repeating items.
"""

from token_mean._counting import IGNORE_INDEX, count_valid_labels
from token_mean._problems import DenominatorError
from token_mean._window import WindowStats
from token_mean.callback import DenominatorMonitor, Divergence, DivergenceError
from token_mean.metrics import TokenMeanLoss
from token_mean.sampler import ExactDistributedSampler
from token_mean.strategy import TokenMeanDDPStrategy

__all__ = [
    "IGNORE_INDEX",
    "DenominatorError",
    "DenominatorMonitor",
    "Divergence",
    "DivergenceError",
    "ExactDistributedSampler",
    "TokenMeanDDPStrategy",
    "TokenMeanLoss",
    "WindowStats",
    "count_valid_labels",
]
