"""A training checkpoint as Hugging Face / diffusers model directories (``disttrain-export``).

``<out>/<module>/`` per module: the family's whole transformers or diffusers model
(``Family.hf_model``) filled with the trained tensors and written by its ``save_pretrained`` (config
and safetensors), plus, for encoders and generators, ``projector.safetensors`` and
``projector.json`` (what the projector connects, its shapes and activation); for the LLM,
``tokens.json`` (the tokenizer the run used and the special ids after its vocabulary) and the
tokenizer's own files when it has them. Each exported directory is also accepted by
``model.<module>.checkpoint``.

The HF key of each tensor comes from the family's ``hf_rules`` applied to the HF model's own keys:
the export runs the import's key map forwards, so there is one formula per key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from disttrain_ds.checkpoint.manifest import inspect_step_dir
from disttrain_ds.checkpoint.read import read_module_state, step_modules, step_recipe, verified_manifest
from disttrain_ds.data.tokenizer import load_tokenizer, special_tokens
from disttrain_ds.errors import ConfigError
from disttrain_ds.mllm.weights import map_key
from disttrain_ds.recipe.graph import encoder_of, graph_of, module_config, module_family

if TYPE_CHECKING:  # annotations only; loading a recipe is not this module's business
    from disttrain_ds.recipe.schema import Recipe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROJECTOR_FILE, PROJECTOR_INFO, TOKENS_INFO = "projector.safetensors", "projector.json", "tokens.json"


class ExportError(ConfigError):
    """Why a checkpoint cannot be exported; one line."""


def hf_key_map(fam, module: str, hf_keys) -> dict[str, str | None]:
    """HF key -> ``layer/param`` (None: no place in our layers), by the family's import rules."""
    return {k: map_key(module, k, fam.hf_rules) for k in hf_keys}


def export_module(recipe: Recipe, module: str, state: dict[str, torch.Tensor], out: Path, dtype: torch.dtype) -> None:
    """Write ``module``'s trained ``state`` ({layer/param: tensor}) as its family's HF model in ``out``."""
    fam, cfg = module_family(recipe, module), module_config(recipe, module)
    if fam.role == "llm":
        cfg = dataclasses.replace(cfg, vocab_size=state[fam.vocab_params[0]].shape[0])
    with torch.device("meta"):
        hf = fam.hf_model(cfg)
    keys = hf_key_map(fam, module, hf.state_dict())
    lacking = [k for k, m in keys.items() if m not in state]
    if lacking:
        raise ExportError(f"export: the {fam.name} model's {lacking[0]} has no trained tensor in {module} "
                          f"({len(lacking)} of {len(keys)})")
    own = {k for k in state if not k.startswith("projector/")}
    unused = sorted(own - set(keys.values()))
    if unused:
        raise ExportError(f"export: {module}'s {unused[0]} has no place in the {fam.name} model ({len(unused)} tensors)")
    # Built on the meta device, so the model is never in memory twice; non-persistent buffers
    # (rotary frequencies) stay unmaterialised, and save_pretrained does not write them.
    hf.load_state_dict({k: state[m].to(dtype) for k, m in keys.items()}, strict=True, assign=True)
    if getattr(hf.config, "tie_word_embeddings", False):
        hf.tie_weights()  # assign=True gave the head its own tensor; tied, save_pretrained writes one
    hf.save_pretrained(str(out))
    projector = {k: v.to(dtype).contiguous() for k, v in state.items() if k.startswith("projector/")}
    if projector:
        from safetensors.torch import save_file

        save_file(projector, str(out / PROJECTOR_FILE))
        llm = graph_of(recipe).llm
        weights = [v for k, v in sorted(projector.items()) if k.endswith(".weight")]
        info = {"in_features": weights[0].shape[1], "out_features": weights[-1].shape[0],"module": module, "family": fam.name, "role": fam.role,
                "connects": f"{module} -> {llm}" if fam.role == "encoder" else f"{llm} -> {module}",
                "form": "Linear, GELU, Linear", "activation": "gelu", "dtype": str(dtype).removeprefix("torch."),
                "tensors": {k: list(v.shape) for k, v in projector.items()},
                "load_with": f"model.<module>.checkpoint: {out.name}/ (this directory)"}
        (out / PROJECTOR_INFO).write_text(json.dumps(info, indent=1) + "\n")


def export_tokenizer(recipe: Recipe, out: Path, vocab: int) -> None:
    """The LLM's tokenizer beside its weights: ``tokens.json`` always, the HF files when it has them."""
    name = recipe.data.tokenizer
    tok = load_tokenizer(name, recipe.data.cache_dir)

    special = special_tokens(tok, audio=encoder_of(recipe, "audio") is not None,
                             generators=len(graph_of(recipe).generators))  # as the run built it
    if special.vocab_size != vocab:
        raise ExportError(f"export: data.tokenizer {name} gives a vocabulary of {special.vocab_size} ids, the checkpoint's "
                          f"LLM has {vocab} rows; is this the tokenizer the run used?")
    hf_tok = getattr(tok, "_tok", None)
    if hf_tok is not None:
        if hasattr(hf_tok, "save_pretrained"):
            hf_tok.save_pretrained(str(out))
        else:  # a tokenizers.Tokenizer (smollm2)
            from transformers import PreTrainedTokenizerFast

            PreTrainedTokenizerFast(tokenizer_object=hf_tok).save_pretrained(str(out))
    info = {"data.tokenizer": name if hf_tok is None else "this directory", "base_vocab": tok.vocab_size,
            "special_tokens": dataclasses.asdict(special), "vocab_size": vocab,
            "from_tokenizer": {k: getattr(special, k) for k in special.own},
            "added": {k: v for k, v in dataclasses.asdict(special).items()
                      if k not in special.own and isinstance(v, int) and v >= tok.vocab_size}}
    (out / TOKENS_INFO).write_text(json.dumps(info, indent=1) + "\n")


def export_checkpoint(step_dir: str | Path, out: str | Path, dtype: str = "fp32",
                      log: Callable[[str], None] = print) -> Path:
    """Export every module of a step directory into ``out`` (which must not exist or be empty)."""
    step_dir, out = Path(step_dir), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {' | '.join(DTYPES)}, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} already exists and is not an empty directory; export never writes over files")
    manifest, why = inspect_step_dir(step_dir)
    if manifest is None:
        raise ExportError(f"--checkpoint {step_dir} is not a complete checkpoint step directory ({why})")
    for module in step_modules(manifest):
        verified_manifest(step_dir, module)  # every file, before anything is written
    recipe = step_recipe(manifest)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for module in graph_of(recipe).names:
            state = read_module_state(step_dir, module)
            export_module(recipe, module, state, partial / module, DTYPES[dtype])
            fam = module_family(recipe, module)
            if fam.role == "llm":
                export_tokenizer(recipe, partial / module, state[fam.vocab_params[0]].shape[0])
            log(f"{module}: {fam.name}, {len(state)} tensors -> {out / module}")
        if out.exists():
            out.rmdir()
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out
