"""Hugging Face models that shift their labels, found without importing ``transformers``.

A causal LM's ``.loss`` (``LlamaForCausalLM``, ``GPT2LMHeadModel``) predicts ``labels[:, 1:]`` from ``input_ids[:,
:-1]``: it never counts a row's first label, which the default count (``labels != -100``) does. A module that holds
such a model and trains with the default count optimizes a different objective without any error, so the
strategies refuse that setup at fit start and ask for the count to be named.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.nn import Module

# `*ForCausalLM` classes: what transformers derives a model's `loss_type` from (modeling_utils, LOSS_MAPPING)
_CAUSAL_LOSS_TYPE = "ForCausalLM"


def label_shifting_model(module: Module) -> Module | None:
    """The first Hugging Face model in ``module`` whose own loss shifts the labels (None: none, or no transformers).

    A model instance means ``transformers`` is imported already: when it is not, nothing is imported here.
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    base: Any = getattr(modeling, "PreTrainedModel", None)
    if base is None:
        return None
    causal_names = _causal_lm_class_names()
    for candidate in module.modules():
        if _shifts_labels(candidate, base, causal_names):
            return candidate
    return None


def _shifts_labels(candidate: Module, base: type, causal_names: frozenset[str]) -> bool:
    if not isinstance(candidate, base):
        return False
    return getattr(candidate, "loss_type", None) == _CAUSAL_LOSS_TYPE or type(candidate).__name__ in causal_names


def _causal_lm_class_names() -> frozenset[str]:
    """The classes ``AutoModelForCausalLM`` builds (``GPT2LMHeadModel`` is one, and its name does not say so)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # a transformers without the mapping: the `loss_type` check alone
        return frozenset()
    return frozenset(name for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() if isinstance(name, str))


def shifted_labels_advice(strategy: str, model: Module) -> str:
    """The error for a label-shifting model trained with the default count."""
    name = type(model).__name__
    return (
        f"`{strategy}` got no `count_fn`, and the LightningModule holds `{name}`, a Hugging Face causal LM whose"
        " `.loss` shifts the labels: the default count (`labels != -100`) would also count each row's first label,"
        " which that loss never predicts, and train on a different objective. Name the count: `count_fn="
        "token_mean.count_shifted_labels` if `training_step` returns the model's `.loss` on unshifted labels, or"
        " `count_fn=token_mean.count_valid_labels` if the collator already shifted the labels (or the loss is"
        " computed outside the model on labels aligned with the logits)."
    )
