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
    missing = [k for k in wanted.values() if k not in found]
    if missing:  # never a silent partial load: a weight left at random init is a wrong model
        raise ValueError(f"{path}: no tensor for {module} {layer_name}.{missing[0]} "
                         f"({len(missing)} of the layer's {len(wanted)} missing)")
    layer.load_state_dict(found)
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


def check_checkpoint(module: str, layers: list[tuple[str, nn.Module]], path: str, rules: Rules, key: str,
                     formats: str = "") -> int:
    """Refuse, in one line naming ``key``, a checkpoint that would leave any weight of ``module``
    at its random init or does not fit its shapes; returns the number of tensors it provides.

    ``layers``: (layer name, layer) pairs, built on the meta device (only names and shapes are
    read). Projectors have no pretrained counterpart and are not expected."""
    from ..configtools import ConfigError

    expected = {f"{name}/{k}": tuple(v.shape) for name, layer in layers if name != "projector"
                for k, v in layer.state_dict().items()}
    try:
        index = _index(path)
    except FileNotFoundError as exc:
        raise ConfigError(f"'{key}' {exc}") from None
    found: dict[str, tuple[str, str]] = {}
    for ckpt_key, f in index.items():
        mapped = map_key(module, ckpt_key, rules)
        if mapped in expected:
            found[mapped] = (f, ckpt_key)
    if not found:
        what = f" (it reads {formats} layouts)" if formats else ""
        raise ConfigError(f"'{key}' {path} holds none of the {module}'s {len(expected)} weights{what}; "
                          "is it another model's checkpoint?")
    missing = [k for k in expected if k not in found]
    if missing:
        raise ConfigError(f"'{key}' {path} lacks {len(missing)} of the {module}'s {len(expected)} weights, "
                          f"e.g. {missing[0]} (a smaller model, or another family?)")
    for local, (f, ckpt_key) in found.items():
        with safe_open(f, framework="pt") as sf:
            shape = tuple(sf.get_slice(ckpt_key).get_shape())
        if shape != expected[local]:
            raise ConfigError(f"'{key}' {path}: {ckpt_key} has shape {shape}, the {module}'s {local} has "
                              f"{expected[local]}")
    return len(found)
