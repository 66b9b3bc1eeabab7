"""Tied input and output embeddings (``tie_word_embeddings``), as transformers computes them: a tied
checkpoint imports, its logits and gradients equal the library's, export writes it tied, the memory
estimate counts the weight once where one stage holds both layers, and the job plans a tied-weight
group between the first and last stage of every pipeline replica."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from disttrain_ds.checkpoint.export import export_module
from disttrain_ds.estimate.memory import estimate, vocab_size
from disttrain_ds.models.layers import Sequential, tie_parameters, tied_keys
from disttrain_ds.parallel import groups as pg
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.imports import check_imports
from disttrain_ds.runtime.setup import build_data_and_spec

SETTINGS = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96,
                num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=256)


def _tied_llama(tmp_path, vocab: int, family: str = "llama"):
    import transformers

    kind = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    cfg = getattr(transformers, f"{kind}Config")(vocab_size=vocab, tie_word_embeddings=True, **SETTINGS)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        hf = getattr(transformers, f"{kind}ForCausalLM")(cfg).eval()
    hf.save_pretrained(tmp_path / family)
    return tmp_path / family, hf


def _llm(spec, tie: bool = True) -> Sequential:
    defs = spec.layers("llm")
    built = {d.name: d.build() for d in defs}
    if tie:
        tie_parameters(built, defs)
    return Sequential(list(built.values()))


def _run(llm, ids):
    return llm((ids, torch.zeros(0, llm.layers[0].embed_tokens.weight.shape[1]), torch.zeros_like(ids)))[0]


def test_a_tied_checkpoint_has_no_lm_head_tensor_yet_imports(tmp_path):
    vocab = vocab_size(load_recipe("tiny_cpu"))
    path, _ = _tied_llama(tmp_path, vocab)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys())
    recipe = load_recipe("tiny_cpu", [f"model.llm.checkpoint={path}"])
    assert recipe.model.llm.tie_embeddings
    check_imports(recipe)  # refused before: "lacks 1 of the llm's weights, e.g. head/lm_head.weight"
    spec = build_data_and_spec(recipe)[1]
    assert tied_keys(spec.layers("llm")) == {"head/lm_head.weight": "embed/embed_tokens.weight"}


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # Llama 3.2 1B / 3B, Qwen2.5 up to 3B
def test_tied_logits_and_gradients_equal_transformers(tmp_path, family):
    vocab = vocab_size(load_recipe("tiny_cpu"))
    path, hf = _tied_llama(tmp_path, vocab, family)
    recipe = load_recipe("tiny_cpu", [f"model.llm.family={family}", f"model.llm.checkpoint={path}"])
    spec = build_data_and_spec(recipe)[1]
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    llm = _llm(spec)
    assert llm.layers[-1].lm_head.weight is llm.layers[0].embed_tokens.weight
    logits = _run(llm, ids)
    theirs = hf(ids).logits
    torch.testing.assert_close(logits, theirs, rtol=1e-5, atol=1e-5)
    # One weight, two uses: its gradient is the embedding's plus the head's, as in transformers.
    logits.square().mean().backward()
    theirs.square().mean().backward()
    torch.testing.assert_close(llm.layers[0].embed_tokens.weight.grad, hf.model.embed_tokens.weight.grad,
                               rtol=1e-5, atol=1e-7)
    # Negative control: the same weights as two untied copies give the embedding only its own share.
    untied = _llm(spec, tie=False)
    _run(untied, ids).square().mean().backward()
    assert (untied.layers[0].embed_tokens.weight.grad - hf.model.embed_tokens.weight.grad).abs().max() > 1e-6


def test_an_untied_config_keeps_two_weights(tmp_path):
    spec = build_data_and_spec(load_recipe("tiny_cpu"))[1]
    assert not tied_keys(spec.layers("llm"))
    llm = _llm(spec)
    assert llm.layers[-1].lm_head.weight is not llm.layers[0].embed_tokens.weight


def test_a_tied_export_writes_one_tensor_and_transformers_reads_the_same_model(tmp_path):
    from transformers import LlamaForCausalLM

    recipe = load_recipe("tiny_cpu", ["model.llm.tie_embeddings=true"])
    spec = build_data_and_spec(recipe)[1]
    llm = _llm(spec)
    state = {f"{d.name}/{k}": v for d, layer in zip(spec.layers("llm"), llm.layers)
             for k, v in layer.state_dict().items()}
    export_module(recipe, "llm", state, tmp_path / "out", torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, spec.llm.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(_run(llm, ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    # The export imports back bit-exact, tie included.
    again = build_data_and_spec(load_recipe("tiny_cpu", [f"model.llm.checkpoint={tmp_path / 'out'}"]))[1]
    back = _llm(again)
    for (k, v), (k2, v2) in zip(llm.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k


def _llm_params(recipe) -> list[int]:
    return [row.params for row in estimate(recipe) if row.module == "llm"]


def test_the_estimate_counts_a_tied_weight_once_per_stage_that_holds_it():
    untied, tied = load_recipe("tiny_cpu"), load_recipe("tiny_cpu", ["model.llm.tie_embeddings=true"])
    table = vocab_size(tied) * tied.model.llm.hidden_size
    assert sum(_llm_params(tied)) == sum(_llm_params(untied)) - table  # reference: one weight
    pp1 = ["layout=disaggregated", "parallel.llm.pp=1"]
    assert _llm_params(load_recipe("tiny_cpu", [*pp1, "model.llm.tie_embeddings=true"])) == \
        [p - table for p in _llm_params(load_recipe("tiny_cpu", pp1))]
    # Two stages: a copy on each (the embedding on the first, the head on the last).
    pp2 = ["layout=disaggregated", "parallel.llm.pp=2"]
    assert _llm_params(load_recipe("tiny_cpu", [*pp2, "model.llm.tie_embeddings=true"])) == \
        _llm_params(load_recipe("tiny_cpu", pp2))


@pytest.mark.parametrize("pp, tp, dp", [(2, 1, 1), (3, 2, 2), (1, 2, 1)])
def test_tied_groups_pair_the_first_and_last_stage_of_every_replica(pp, tp, dp):
    recipe = load_recipe("tiny_cpu", ["layout=disaggregated", f"parallel.llm.pp={pp}", f"parallel.llm.tp={tp}",
                                      f"parallel.llm.dp={dp}", f"train.global_batch={4 * dp}"])
    topo = topology_of(recipe)
    llm = next(m for m in topo.modules if m.name == "llm")
    specs = pg.plan_groups(topo.modules, topo.world_size, frozenset({"llm"}))
    tied = [s for s in specs if s.key[:2] == ("llm", pg.TIED)]
    assert len(tied) == (dp * tp if pp > 1 else 0)
    for s in tied:
        first, last = (llm.coords(r) for r in s.ranks)
        assert (first[0], last[0]) == (0, pp - 1) and first[1:] == last[1:]
    # Untied: the same plan without them (negative control of the count above).
    assert not [s for s in pg.plan_groups(topo.modules, topo.world_size) if s.key[1:2] == (pg.TIED,)]


def test_the_optimizer_steps_a_tied_weight_once():
    from disttrain_ds.runtime.setup import build_optimizer, param_groups

    recipe = load_recipe("tiny_cpu", ["model.llm.tie_embeddings=true"])
    spec = build_data_and_spec(recipe)[1]
    llm = _llm(spec)
    groups = param_groups(recipe, "llm", [(d.name, layer) for d, layer in zip(spec.layers("llm"), llm.layers)])
    listed = [id(p) for g in groups for p in g["params"]]
    assert len(listed) == len(set(listed)) == len(list(llm.parameters()))
    build_optimizer(recipe, groups)  # torch warns of (and would step twice) a duplicated parameter
