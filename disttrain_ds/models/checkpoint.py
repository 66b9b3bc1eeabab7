"""Initialise modules from local weights instead of random init (nothing is downloaded).

Accepted: a ``.safetensors`` file or a directory of them (sharded is fine) saved by
transformers 5 / diffusers ``save_pretrained`` in a layout the module's family maps (its
``hf_rules``: ViTModel, LlamaForCausalLM, Qwen2ForCausalLM, UNet2DConditionModel, ...), or a
file of this project's own ``module/layer/param`` keys. Each pipeline layer reads only its own tensors (lazily, via ``safe_open``), so a stage never loads the whole
model. Projectors have no pretrained counterpart and keep their seeded init.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from torch import nn

from .layers import LayerDef

Rules = Sequence[tuple[str, str]]
"""(regex on a checkpoint key, replacement giving ``layer/param``): a family's ``hf_rules``."""


def map_key(module: str, key: str, rules: Rules) -> str | None:
    """'layer/param' for a checkpoint key of ``module``, or None if it has no place here."""
    if key.startswith(module + "/"):
        return key[len(module) + 1 :]
    for pattern, repl in rules:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    return None


@functools.lru_cache(maxsize=8)
def _index(path: str) -> dict[str, str]:
    """Checkpoint key -> file holding it."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
    elif p.is_file() and p.suffix == ".safetensors":
        files = [p]
    else:
        files = []
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights found")
    index: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                index[k] = str(f)
    return index


def load_layer_weights(module: str, layer_name: str, layer: nn.Module, path: str, rules: Rules) -> int:
    """Copy this layer's tensors from the checkpoint; returns how many were loaded."""
    wanted = {f"{layer_name}/{k}": k for k in layer.state_dict()}
    found: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for ckpt_key, f in _index(path).items():
        mapped = map_key(module, ckpt_key, rules)
        if mapped in wanted:
            by_file.setdefault(f, []).append((ckpt_key, wanted[mapped]))
    for f, pairs in by_file.items():
        with safe_open(f, framework="pt") as sf:
            for ckpt_key, local in pairs:
                found[local] = sf.get_tensor(ckpt_key)
    own = layer.state_dict()
    for k, v in found.items():
        if own[k].shape != v.shape:
            raise ValueError(
                f"{path}: {module} {layer_name}.{k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}"
            )
    layer.load_state_dict(found, strict=False)
    return len(found)


def with_checkpoint(module: str, defs: list[LayerDef], path: str, rules: Rules) -> list[LayerDef]:
    """Layer builders that load their weights from ``path`` after the seeded init."""
    if not path:
        return defs
    if not Path(path).exists():
        raise FileNotFoundError(f"model.{module}.checkpoint: {path} does not exist")

    def wrap(d: LayerDef) -> LayerDef:
        def build() -> nn.Module:
            layer = d.build()
            load_layer_weights(module, d.name, layer, path, rules)
            return layer

        return dataclasses.replace(d, build=build)

    return [wrap(d) for d in defs]


def save_layer_state(state: dict[str, torch.Tensor], path: str) -> None:
    """Write ``module/layer/param`` tensors as safetensors (loadable by ``with_checkpoint``)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, path)
