"""Initialise modules from local weights instead of random init (nothing is downloaded).

Accepted: a ``.safetensors`` file or a directory of them (sharded is fine) saved by
transformers 5 / diffusers ``save_pretrained`` in a layout the module's family maps (its
``hf_rules``: ViTModel, LlamaForCausalLM, Qwen2ForCausalLM, UNet2DConditionModel, ...), or a
file of this project's own ``module/layer/param`` keys; a directory written by ``disttrain-export``
(its ``projector.safetensors`` included); or a training step directory / one of its module folders
(``checkpoint/read.py``: any DP / TP / PP layout, verified against its manifest). Each pipeline
layer reads only its own tensors (lazily), so a stage never loads the whole model. Projectors load
from checkpoints that have them and otherwise keep their seeded init. A vocabulary tensor with
fewer rows than the tokenizer needs grows (``grow_vocab``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Protocol, Sequence

import torch
from safetensors import safe_open
from torch import nn

from disttrain_ds.errors import ConfigError
from disttrain_ds.models.layers import LayerDef

Rules = Sequence[tuple[str, str]]
"""(regex on a checkpoint key, replacement giving ``layer/param``): a family's ``hf_rules``."""


class StepDirs(Protocol):
    """A reader of training step directories, handed in by whoever builds the model
    (``checkpoint/read.py::STEP_DIRS``): the model knows no checkpoint format of the runtime."""

    def locate(self, path: str) -> tuple[Path, str | None] | None:
        """(step directory, module folder or None) if ``path`` is a step directory or one of its folders."""

    def read(self, step_dir: Path, folder: str, layer_names: list[str]) -> dict[str, torch.Tensor]:
        """Whole tensors ``layer/param`` of those layers of the module folder."""

    def shapes(self, step_dir: Path, folder: str) -> dict[str, tuple]:
        """Every tensor's shape, after checking every file of the folder (size and SHA-256)."""


def map_key(module: str, key: str, rules: Rules) -> str | None:
    """'layer/param' for a checkpoint key of ``module``, or None if it has no place here."""
    if key.startswith(module + "/"):
        return key[len(module) + 1 :]
    if key.startswith("projector/"):  # an exported projector.safetensors: already layer/param
        return key
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


class _Files:
    """safetensors files (HF layouts, an exported directory, our own keys) as ``layer/param`` tensors."""

    def __init__(self, path: str, module: str, rules: Rules):
        self.path, self.where = path, {}
        for ckpt_key, f in _index(path).items():
            mapped = map_key(module, ckpt_key, rules)
            if mapped is not None:
                self.where[mapped] = (f, ckpt_key)

    def shapes(self) -> dict[str, tuple]:
        out = {}
        for local, (f, ckpt_key) in self.where.items():
            with safe_open(f, framework="pt") as sf:
                out[local] = tuple(sf.get_slice(ckpt_key).get_shape())
        return out

    def read(self, layer_name: str) -> dict[str, torch.Tensor]:
        out = {}
        for local, (f, ckpt_key) in self.where.items():
            if local.split("/", 1)[0] == layer_name:
                with safe_open(f, framework="pt") as sf:
                    out[local] = sf.get_tensor(ckpt_key)
        return out

    def name(self, local: str) -> str:
        return self.where[local][1]

    @property
    def has_projector(self) -> bool:
        return any(k.startswith("projector/") for k in self.where)


class _StepDir:
    """A training step directory (or one module folder of it): every tensor of the module, projector included."""

    has_projector = True

    def __init__(self, step_dir, folder: str, reader: StepDirs):
        self.step_dir, self.folder, self.reader = step_dir, folder, reader

    def read(self, layer_name: str) -> dict[str, torch.Tensor]:
        return self.reader.read(self.step_dir, self.folder, [layer_name])

    def shapes(self) -> dict[str, tuple]:
        """Checks every file of the module (size and SHA-256) first: what runs before any process starts."""
        return self.reader.shapes(self.step_dir, self.folder)

    def name(self, local: str) -> str:
        return f"{self.folder}/{local}"


@functools.lru_cache(maxsize=8)
def open_source(path: str, module: str, rules: Rules, step_dirs: StepDirs | None = None):
    """What ``path`` offers ``module``: a step directory or module folder of one (read by
    ``step_dirs``), else safetensors."""
    found = step_dirs.locate(path) if step_dirs is not None else None
    if found is not None:
        return _StepDir(found[0], found[1] or module, step_dirs)
    return _Files(path, module, tuple(tuple(r) for r in rules))


def grow_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with rows appended up to ``rows``, each the mean of its existing rows (deterministic):
    ids a tokenizer adds beyond a checkpoint's vocabulary start near the embedding's centre."""
    extra = t.float().mean(0, keepdim=True).to(t.dtype).expand(rows - t.shape[0], *t.shape[1:])
    return torch.cat([t, extra])


def fits(local: str, shape: tuple, want: tuple, vocab_params: Sequence[str]) -> bool:
    """Whether a checkpoint tensor of ``shape`` can initialise ``local`` of shape ``want`` (equal, or
    a vocabulary tensor with fewer rows)."""
    return shape == want or (local in vocab_params and len(shape) == len(want) and shape[1:] == want[1:]
                             and 0 < shape[0] < want[0])


def load_layer_weights(module: str, layer_name: str, layer: nn.Module, path: str, rules: Rules,
                       vocab_params: Sequence[str] = (), step_dirs: StepDirs | None = None,
                       ties: Sequence[tuple[str, str]] = ()) -> int:
    """Copy this layer's tensors from the checkpoint; returns how many were loaded (0: a projector
    the checkpoint has none of: it keeps its seeded init). A tied parameter (``ties``: own name,
    ``leader_layer/param``) is read from its leader: a tied checkpoint need not hold it twice."""
    src = open_source(path, module, tuple(rules), step_dirs)
    if layer_name == "projector" and not src.has_projector:
        return 0
    own = layer.state_dict()
    found = {k.split("/", 1)[1]: v for k, v in src.read(layer_name).items()}
    for param, lead in ties:
        leader = src.read(lead.split("/", 1)[0])
        if lead in leader:
            found[param] = leader[lead]
    extra = sorted(k for k in found if k not in own)
    if extra and isinstance(src, _StepDir):  # a training checkpoint holds exactly its layers' tensors
        raise ValueError(f"{path}: {module} {layer_name} has no tensor {extra[0]} (another model's checkpoint?)")
    found = {k: v for k, v in found.items() if k in own}  # HF files may hold more (a decoder, a pooler)
    for k, v in found.items():
        local = f"{layer_name}/{k}"
        if not fits(local, tuple(v.shape), tuple(own[k].shape), vocab_params):
            raise ValueError(
                f"{path}: {module} {layer_name}.{k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}"
            )
        if v.shape != own[k].shape:
            found[k] = grow_vocab(v, own[k].shape[0])
    missing = [k for k in own if k not in found]
    if missing:  # never a silent partial load: a weight left at random init is a wrong model
        raise ValueError(f"{path}: no tensor for {module} {layer_name}.{missing[0]} "
                         f"({len(missing)} of the layer's {len(own)} missing)")
    layer.load_state_dict(found)
    return len(found)


def with_checkpoint(module: str, defs: list[LayerDef], path: str, rules: Rules,
                    vocab_params: Sequence[str] = (), step_dirs: StepDirs | None = None) -> list[LayerDef]:
    """Layer builders that load their weights from ``path`` after the seeded init (``step_dirs``:
    how to read a training step directory, if ``path`` may be one)."""
    if not path:
        return defs
    if not Path(path).exists():
        raise FileNotFoundError(f"model.{module}.checkpoint: {path} does not exist")

    def wrap(d: LayerDef) -> LayerDef:
        def build() -> nn.Module:
            layer = d.build()
            load_layer_weights(module, d.name, layer, path, rules, vocab_params, step_dirs, d.ties)
            return layer

        return dataclasses.replace(d, build=build)

    return [wrap(d) for d in defs]


def save_layer_state(state: dict[str, torch.Tensor], path: str) -> None:
    """Write ``module/layer/param`` tensors as safetensors (loadable by ``with_checkpoint``)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, path)


def check_checkpoint(module: str, layers: list[tuple[str, nn.Module]], path: str, rules: Rules, key: str,
                     formats: str = "", vocab_params: Sequence[str] = (), step_dirs: StepDirs | None = None,
                     ties: dict[str, str] | None = None) -> int:
    """Refuse, in one line naming ``key``, a checkpoint that would leave any weight of ``module``
    at its random init or does not fit its shapes; returns the number of tensors it provides.

    ``layers``: (layer name, layer) pairs, built on the meta device (only names and shapes are
    read). A projector is expected only from a checkpoint that has one (a training step directory,
    an exported directory); otherwise it keeps its seeded init. ``ties`` (``models/layers.py::tied_keys``):
    tied parameters, read from their leader's tensor."""
    try:
        src = open_source(path, module, tuple(rules), step_dirs)
        shapes = src.shapes()
    except (FileNotFoundError, ConfigError) as exc:
        raise ConfigError(f"'{key}' {exc}") from None
    expected = {f"{name}/{k}": tuple(v.shape) for name, layer in layers if name != "projector" or src.has_projector
                for k, v in layer.state_dict().items() if f"{name}/{k}" not in (ties or {})}
    found = {k: s for k, s in shapes.items() if k in expected}
    if not found:
        what = f" (it reads {formats} layouts and training step directories)" if formats else ""
        raise ConfigError(f"'{key}' {path} holds none of the {module}'s {len(expected)} weights{what}; "
                          "is it another model's checkpoint?")
    missing = [k for k in expected if k not in found]
    if missing:
        raise ConfigError(f"'{key}' {path} lacks {len(missing)} of the {module}'s {len(expected)} weights, "
                          f"e.g. {missing[0]} (a smaller model, or another family?)")
    extra = sorted(k for k in shapes if k not in expected and isinstance(src, _StepDir))
    if extra:
        raise ConfigError(f"'{key}' {path} holds {src.name(extra[0])}, which the {module} does not have "
                          f"({len(extra)} such tensors): another model's checkpoint?")
    for local, shape in found.items():
        if not fits(local, shape, expected[local], vocab_params):
            raise ConfigError(f"'{key}' {path}: {src.name(local)} has shape {shape}, the {module}'s {local} has "
                              f"{expected[local]}")
    return len(found)
