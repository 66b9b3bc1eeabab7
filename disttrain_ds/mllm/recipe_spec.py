"""A recipe's model spec: which module fills which field of ``MLLMSpec``, written once for the
runtime, the memory estimate and the checkpoint reader."""

from __future__ import annotations

from dataclasses import replace

from disttrain_ds.mllm.model import MLLMSpec
from disttrain_ds.mllm.weights import StepDirs
from disttrain_ds.recipe.graph import encoder_of, graph_of
from disttrain_ds.recipe.schema import Recipe
from disttrain_ds.samples import SpecialTokens


def recipe_spec(recipe: Recipe, special: SpecialTokens, vocab: int, *, step_dirs: StepDirs | None = None,
                weights: bool = True) -> MLLMSpec:
    """The model of ``recipe`` with an LLM vocabulary of ``vocab`` rows and the token ids ``special``.

    ``weights=False`` drops every ``checkpoint`` (a build on the meta device reads nothing);
    ``step_dirs`` reads a checkpoint that is a training step directory (handed in by the caller:
    the model knows no checkpoint reader)."""
    graph = graph_of(recipe)
    by_name = {n: recipe.model.modules[n] for n in graph.names}
    if not weights:
        by_name = {n: replace(c, checkpoint="") for n, c in by_name.items()}
    by_name[graph.llm] = replace(by_name[graph.llm], vocab_size=vocab)
    return MLLMSpec(by_name, {n: graph.role(n) for n in graph.names}, special, recipe.seed,
                    recipe.model.gen_loss_weight, step_dirs=step_dirs)


def meta_spec(recipe: Recipe, vocab: int) -> MLLMSpec:
    """The recipe's model spec with nothing to read (no checkpoints), for builds on the meta device."""
    special = SpecialTokens.after(0, audio=encoder_of(recipe, "audio") is not None)
    return recipe_spec(recipe, special, vocab, weights=False)
