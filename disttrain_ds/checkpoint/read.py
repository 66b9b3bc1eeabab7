"""A training step directory read back as whole tensors, whatever layout wrote it.

DeepSpeed writes one file per pipeline layer and tensor-parallel rank into the module's folder
(``<module>/layer_XX-model_YY-model_states.pt``: XX the layer's index in the module, YY the TP
rank; only DP replica 0 writes, every pipeline stage its own layers). The checkpoint's manifest
records the model and parallel degrees that wrote it, so the layers are rebuilt on the meta device
(no memory) and cut by the same ``shard_layer`` the runtime used: which parameter was split along
which dimension then comes from the families' TP plans, never from a second table.

Every file of the module is checked against the manifest (sizes first, each file's SHA-256 just
before it is read: a pipeline stage hashes only the files it loads) and read without running code
(``checkpoint.files.safe_load``); ``verified_manifest`` checks a whole module up front (export does).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import torch

from disttrain_ds.checkpoint.files import CheckpointFileError, file_problem, first_problem, safe_load
from disttrain_ds.checkpoint.manifest import MANIFEST, inspect_step_dir
from disttrain_ds.errors import ConfigError
from disttrain_ds.families import clear_build_caches
from disttrain_ds.mllm.recipe_spec import meta_spec
from disttrain_ds.parallel.tensor_parallel import TPContext, merge_shards, shard_layer, tp_split
from disttrain_ds.recipe.graph import graph_of, topology_of
from disttrain_ds.recipe.schema import recipe_from_data

LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
"""DeepSpeed's per-layer file name (``PipelineModule.ckpt_layer_path``): layer index, TP rank."""


def locate(path: str | Path) -> tuple[Path, str | None] | None:
    """(step directory, module folder name or None) when ``path`` is a step directory or one of
    its module folders; None for anything else."""
    p = Path(path)
    if p.is_dir() and (p / MANIFEST).is_file():
        return p, None
    if p.is_dir() and (p.parent / MANIFEST).is_file():
        return p.parent, p.name
    return None


def step_modules(manifest: dict) -> list[str]:
    """Module folders a checkpoint holds."""
    return sorted({n.split("/")[0] for n in manifest["files"] if "/" in n and LAYER_FILE.match(n.rsplit("/", 1)[-1])})


@functools.lru_cache(maxsize=16)
def _checked(step_dir: str, module: str, full: bool) -> dict:
    manifest, why = inspect_step_dir(Path(step_dir))
    if manifest is None:
        raise CheckpointFileError(f"{step_dir} is not a complete checkpoint ({why})")
    if module not in step_modules(manifest):
        raise CheckpointFileError(f"{step_dir} holds no '{module}' module (it holds {', '.join(step_modules(manifest))})")
    files = manifest["files"]
    problem = first_problem(Path(step_dir), files, sorted(n for n in files if n.startswith(module + "/")), full=full)
    if problem:
        raise CheckpointFileError(f"{step_dir} is damaged: {problem}")
    for p in sorted((Path(step_dir) / module).rglob("*")):
        name = p.relative_to(step_dir).as_posix()
        if p.is_file() and name not in files:
            raise CheckpointFileError(f"{step_dir} is damaged: {name} is not listed in the manifest")
    return manifest


def verified_manifest(step_dir: str | Path, module: str, full: bool = True) -> dict:
    """The manifest of ``step_dir`` once every file of ``module`` matched it (``full``: size and
    SHA-256, else size only; once per process); ``CheckpointFileError`` naming the first problem
    otherwise. Files are checksummed again as they are read (``_load``)."""
    return _checked(str(Path(step_dir).resolve()), module, full)


def step_recipe(manifest: dict):
    """The recipe sections that wrote a checkpoint (model, data, parallel degrees, seed), rebuilt from
    its manifest: what shapes and splits its layers have."""
    fp = copy.deepcopy(manifest["fingerprint"])
    graph_form = "modules" in fp["model"]
    data = {"name": "checkpoint", "layout": fp["layout"], "seed": fp["seed"], "model": fp["model"], "data": fp["data"],
            "parallel": {"modules": fp["parallel"]} if graph_form else fp["parallel"]}
    try:
        return recipe_from_data(data, "checkpoint manifest")
    except ConfigError as exc:
        raise CheckpointFileError(f"its manifest does not describe a model this version builds: {exc}") from None


def layer_files(step_dir: Path, module: str) -> dict[int, dict[int, Path]]:
    """Layer index -> TP rank -> file, from the module folder's DeepSpeed file names."""
    out: dict[int, dict[int, Path]] = {}
    for f in (step_dir / module).iterdir():
        m = LAYER_FILE.match(f.name)
        if m:
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
    return out


@functools.lru_cache(maxsize=4096)
def _verify_file(path: str) -> None:
    """Size and SHA-256 of one file against its step directory's manifest (once per process)."""
    step_dir = Path(path).parent.parent
    files = verified_manifest(step_dir, Path(path).parent.name, full=False)["files"]
    problem = file_problem(step_dir, Path(path).relative_to(step_dir).as_posix(), files[Path(path).relative_to(step_dir).as_posix()])
    if problem:
        raise CheckpointFileError(f"{step_dir} is damaged: {problem}")


def _load(path: Path) -> dict[str, torch.Tensor]:
    """One layer file, checked against the manifest, read without running code."""
    _verify_file(str(path.resolve()))
    state = safe_load(path, map_location="cpu")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointFileError(f"checkpoint file {path} does not hold one layer's tensors")
    return state


def _vocab_rows(files: dict[int, dict[int, Path]]) -> int:
    """The LLM vocabulary a checkpoint was trained with: its embedding's rows (embeddings are never split)."""
    for key, t in _load(files[min(files)][0]).items():
        if key.endswith("embed_tokens.weight"):
            return t.shape[0]
    raise CheckpointFileError(f"{files[min(files)][0]}: the LLM's first layer holds no embed_tokens.weight")


def _meta_layer(layer_def, tp: int):
    """(whole layer, this layer cut for ``tp`` ranks) on the meta device."""
    with torch.device("meta"):
        return layer_def.build(), shard_layer(layer_def.build(), TPContext(None, 0, tp))


@functools.lru_cache(maxsize=16)
def _layout(step_dir: str, folder: str) -> tuple[list, int, dict[int, dict[int, Path]]]:
    """(layer defs, TP degree, layer files) of a module folder (once per process: the LLM's
    vocabulary is read from its embedding file)."""
    manifest = verified_manifest(step_dir, folder, full=False)  # each file's checksum: as it is read
    recipe = step_recipe(manifest)
    if folder not in recipe.model.modules:
        raise CheckpointFileError(f"{step_dir}: its manifest has no module '{folder}'")
    tp = topology_of(recipe).module(folder).tp  # monolithic: encoders and generators take the LLM's
    files = layer_files(Path(step_dir), folder)
    llm = graph_of(recipe).llm
    vocab = _vocab_rows(files if folder == llm else layer_files(Path(step_dir), llm)) if llm in step_modules(manifest) else 1
    defs = meta_spec(recipe, vocab).layers(folder)
    if sorted(files) != list(range(len(defs))):
        raise CheckpointFileError(f"{step_dir}/{folder} holds layer files {sorted(files)}, the module has "
                                  f"{len(defs)} layers (0..{len(defs) - 1})")
    return defs, tp, files


def read_module_state(step_dir: str | Path, module: str, layers: list[str] | None = None,
                      folder: str | None = None) -> dict[str, torch.Tensor]:
    """``{layer/param: full unsharded tensor}`` of ``module`` in a step directory, its projector
    included, in the dtype it was saved in; only ``layers`` (names) if given.

    ``folder``: the module folder to read when it differs from ``module`` (a checkpoint of another
    graph). Every file is verified against the manifest first; a missing TP shard, a missing or
    unexpected tensor, or a shape the model does not have is a ``CheckpointFileError`` naming it."""
    step_dir, folder = Path(step_dir), folder or module
    defs, tp, files = _layout(str(step_dir.resolve()), folder)
    out: dict[str, torch.Tensor] = {}
    try:
        for idx, d in enumerate(defs):
            if layers is not None and d.name not in layers:
                continue
            ranks = files[idx]
            if sorted(ranks) != list(range(tp)):
                missing = next(r for r in range(tp) if r not in ranks)
                raise CheckpointFileError(f"{step_dir}/{folder}: layer {idx} ({d.name}) lacks its TP rank {missing} file "
                                          f"(written with tp={tp})")
            whole, cut = _meta_layer(d, tp)
            full, split = whole.state_dict(), tp_split(cut)
            shards = [_load(ranks[r]) for r in range(tp)]
            for s, f in zip(shards, (ranks[r] for r in range(tp))):
                if s.keys() != full.keys():
                    odd = sorted(set(s) ^ set(full))[0]
                    raise CheckpointFileError(f"{f}: tensor {odd} {'is unexpected' if odd in s else 'is missing'} "
                                              f"in layer {d.name}")
            for key, want in full.items():
                parts = [s[key] for s in shards]
                t = merge_shards(parts, *split[key]) if key in split else parts[0]
                if tuple(t.shape) != tuple(want.shape):
                    raise CheckpointFileError(f"{ranks[0]}: {key} has shape {tuple(t.shape)} (tp={tp}), layer "
                                              f"{d.name} has {tuple(want.shape)}")
                out[f"{d.name}/{key}"] = t
    finally:
        clear_build_caches()
    return out


def module_shapes(step_dir: str | Path, module: str, folder: str | None = None) -> dict[str, tuple]:
    """``{layer/param: full shape}`` of a module in a step directory, from its manifest's model (no
    tensor is read; every layer file present at its recorded size)."""
    folder = folder or module
    defs, tp, files = _layout(str(Path(step_dir).resolve()), folder)
    out = {}
    try:
        for idx, d in enumerate(defs):
            if sorted(files[idx]) != list(range(tp)):
                missing = next(r for r in range(tp) if r not in files[idx])
                raise CheckpointFileError(f"{step_dir}/{folder}: layer {idx} ({d.name}) lacks its TP rank {missing} file "
                                          f"(written with tp={tp})")
            with torch.device("meta"):
                out.update({f"{d.name}/{k}": tuple(v.shape) for k, v in d.build().state_dict().items()})
    finally:
        clear_build_caches()
    return out


class _StepDirReader:
    """``models.checkpoint.StepDirs`` over this module: how a model reads a training step directory."""

    def locate(self, path: str) -> tuple[Path, str | None] | None:
        return locate(path)

    def read(self, step_dir: Path, folder: str, layer_names: list[str]) -> dict[str, torch.Tensor]:
        return read_module_state(step_dir, folder, layer_names)

    def shapes(self, step_dir: Path, folder: str) -> dict[str, tuple]:
        verified_manifest(step_dir, folder)
        return module_shapes(step_dir, folder)


STEP_DIRS = _StepDirReader()
"""Handed to ``MLLMSpec`` (``step_dirs``) and ``check_checkpoint`` by the runtime."""
