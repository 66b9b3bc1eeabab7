"""The tensors inside a nested value (tuples, lists, dicts, Hugging Face model outputs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, depth first, in order; anything else is skipped."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    elif hasattr(value, "to_tuple"):  # transformers' ModelOutput
        value = value.to_tuple()
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []
