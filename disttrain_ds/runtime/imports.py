"""Checks of the weights a recipe starts from (``model.<module>.checkpoint``), before any process starts."""

from __future__ import annotations

from disttrain_ds.checkpoint.read import STEP_DIRS
from disttrain_ds.estimate.memory import meta_layers, vocab_size
from disttrain_ds.mllm.weights import check_checkpoint
from disttrain_ds.models.layers import tied_keys
from disttrain_ds.recipe.graph import graph_of, module_family, module_key


def check_imports(recipe) -> None:
    """Every module that starts from a checkpoint finds each of its weights there, in its shape
    (projectors aside); else one ``ConfigError`` line naming the module's ``checkpoint`` key."""
    vocab = None
    for name in graph_of(recipe).names:
        cfg = recipe.model.modules[name]
        if not cfg.checkpoint:
            continue
        vocab = vocab if vocab is not None else vocab_size(recipe)
        pairs = meta_layers(recipe, name, vocab)  # built on the meta device: shapes only
        fam = module_family(recipe, name)
        check_checkpoint(name, [(d.name, layer) for d, layer in pairs], cfg.checkpoint, fam.hf_rules,
                         f"{module_key(recipe, name)}.checkpoint", fam.hf_formats, fam.vocab_params, STEP_DIRS,
                         tied_keys([d for d, _ in pairs]))
