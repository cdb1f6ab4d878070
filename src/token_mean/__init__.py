"""Exact global token-mean gradients for Lightning DDP with gradient accumulation."""

from token_mean._counting import IGNORE_INDEX, count_valid_labels
from token_mean._errors import DenominatorError
from token_mean._window import WindowStats
from token_mean.strategy import TokenMeanDDPStrategy

__all__ = ["IGNORE_INDEX", "DenominatorError", "TokenMeanDDPStrategy", "WindowStats", "count_valid_labels"]
