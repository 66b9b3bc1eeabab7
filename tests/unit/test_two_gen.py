"""Several generators in one graph: query tokens, targets, routing of the LLM's states, losses,
figures and recipe writing (no processes; tests/multiproc/test_two_gen.py runs the layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disttrain_ds.cli import plan as cli
from disttrain_ds.data.producer_worker import decode, encode
from disttrain_ds.data.validate import sample_problems
from disttrain_ds.errors import ConfigError
from disttrain_ds.mllm.model import BatchNorms, ReferenceMLLM, collate
from disttrain_ds.parallel.roles import LLMRole
from disttrain_ds.planner import optimize
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.setup import build_data_and_spec, shape_spec
from disttrain_ds.samples import PackedSample, SpecialTokens

TINY = Path(optimize.__file__).parent / "examples" / "tiny_cpu.json"


@pytest.fixture(scope="module")
def two():
    recipe = load_recipe("tiny_two_gen")
    source, spec = build_data_and_spec(recipe)
    samples = [s for step in range(3) for s in source.global_batch(step)]
    return recipe, source, spec, samples


def test_one_generator_keeps_its_vocabulary_and_each_further_one_gets_its_own_query_token():
    one = SpecialTokens.after(256)
    assert one.vocab_size == 262 and one.queries == (one.gen,)
    both = SpecialTokens.after(256, audio=True, generators=2)
    assert both.audio == 262 and both.queries == (260, 263) and both.vocab_size == 264
    ids = torch.tensor([1, 257, 260, 263, 262, 256])
    assert both.no_label(ids).tolist() == [False, True, True, True, True, True]


def test_synthetic_samples_hold_targets_for_none_one_or_both_generators(two):
    recipe, source, spec, samples = two
    shape = shape_spec(recipe)
    assert spec.generators == ("painter", "sketcher")
    kinds = set()
    for s in samples:
        assert sample_problems(s, source.special, 8, 128, shape.gens) == []
        counts = tuple(int(s.targets(k).shape[0]) for k in range(2))
        assert s.gen_targets[0].shape[1:] == (3, 16, 16) and s.gen_targets[1].shape[1:] == (2, 8, 8)
        assert counts == tuple(len(_runs(s.input_ids == q)) for q in source.special.queries)
        kinds.add(tuple(n > 0 for n in counts))
    assert kinds == {(False, False), (True, False), (False, True), (True, True)}


def _runs(mask: torch.Tensor) -> list[int]:
    starts = mask & ~torch.cat([torch.tensor([False]), mask[:-1]])
    return starts.nonzero().flatten().tolist()


def test_targets_for_every_generator_survive_producers_and_spool_files(two):
    *_, samples = two
    for back in (decode(encode(samples)), [PackedSample.from_plain(s.to_plain()) for s in samples]):
        for a, b in zip(samples, back):
            assert len(a.gen_targets) == len(b.gen_targets) == 2
            assert torch.equal(a.gen_targets[1], b.gen_targets[1]) and all(torch.equal(u, v) for u, v in zip(a.gen_targets, b.gen_targets))


def test_each_generator_gets_the_llm_states_at_its_own_queries_only(two):
    _, _, spec, samples = two
    mb = collate(samples[:4], BatchNorms.of(samples[:4], 1, 2), spec)
    hidden = torch.randn(*mb.input_ids.shape, spec.llm.hidden_size)
    painter, sketcher = LLMRole(spec).boundary_outputs((None, hidden), mb)
    assert painter.shape[1:] == (4, spec.llm.hidden_size) and sketcher.shape[1:] == (2, spec.llm.hidden_size)
    assert torch.equal(sketcher.flatten(0, 1), hidden[mb.input_ids == spec.special.query(1)])
    assert torch.equal(painter.flatten(0, 1), hidden[mb.input_ids == spec.special.gen])
    assert mb.sample_rows["gen_states/sketcher"] == [1] * sum(int(s.gen_targets[1].shape[0]) for s in samples[:4])
    assert mb.gens["sketcher"].noisy.shape[1:] == (2, 8, 8)


def test_each_generator_loss_is_a_mean_over_its_own_images_and_moves_only_its_rows(two):
    _, _, spec, samples = two
    only_sketch = [s for s in samples if s.gen_targets[0].shape[0] == 0 and s.gen_targets[1].shape[0] > 0][:2]
    model = ReferenceMLLM(spec)
    out = model(collate(only_sketch, BatchNorms.of(only_sketch, 1), spec))
    loss = {k: float(v.detach()) for k, v in out.items()}
    assert loss["gen/painter"] == 0.0 and loss["gen/sketcher"] > 0 and loss["gen"] == pytest.approx(loss["gen/sketcher"])
    out["gen"].backward()
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0 for p in model.painter.parameters())
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.sketcher.parameters())


def test_step_figures_name_both_generators(two):
    from disttrain_ds.metrics.step_flops import MfuMeter

    _, _, spec, samples = two
    meter = MfuMeter(spec, dict.fromkeys(spec.names, 1), 4, 1.0, None)
    figures = meter(samples, 1.0)
    assert figures["perf/mfu/painter"] > 0 and figures["perf/mfu/sketcher"] > 0
    flops = meter.count(samples)
    assert figures["perf/tflops_per_gpu/overall"] == pytest.approx(
        sum(meter.count.module(n, samples) for n in spec.names) / 4 / 1e12)
    assert set(flops.modules) == set(spec.names) and flops.modules["sketcher"] > 0


def test_two_generators_need_the_synthetic_source():
    with pytest.raises(ConfigError, match="'data.source'.*painter, sketcher"):
        load_recipe("tiny_two_gen", ["data.source=paper_stats"])


def test_write_recipe_for_two_generators_writes_one_that_loads(run_main, tmp_path):
    data = json.loads(TINY.read_text())
    mods = data["modules"]
    data["gpus"] = 6
    data["global_batch"] = 4
    data["modules"] = {"vision": {**mods["encoder"], "role": "encoder"}, "llm": mods["llm"],
                       "painter": {**mods["generator"], "role": "generator"},
                       "sketcher": {"role": "generator", "layers": 4, "cost_ms": {"1": 6.0}}}
    profile, out = tmp_path / "two.json", tmp_path / "two.yaml"
    profile.write_text(json.dumps(data))
    code, stdout, err = run_main(cli.main, "--profile", str(profile), "--json", "--recipe", "tiny_two_gen",
                                 "--write-recipe", str(out))
    assert code == 0, err
    plan, recipe = json.loads(stdout), load_recipe(out)
    for name in ("vision", "llm", "painter", "sketcher"):
        mp = recipe.parallel.modules[name]
        assert (mp.dp, mp.tp, mp.pp) == tuple(plan[name][k] for k in ("dp", "tp", "pp"))


def test_both_generators_export_by_module_name_and_the_tokens_name_both_queries(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from export_checks import output_diff, perturbed_states, write_step_dir

    from disttrain_ds.checkpoint.export import export_checkpoint
    from disttrain_ds.estimate.memory import vocab_size
    from disttrain_ds.mllm.recipe_spec import meta_spec

    recipe = load_recipe("tiny_two_gen", ["layout=disaggregated", "parallel.modules.sketcher.tp=2"])
    spec = meta_spec(recipe, vocab_size(recipe))
    states = perturbed_states(spec, spec.names)
    out = export_checkpoint(write_step_dir(tmp_path / "ck", recipe, spec, states), tmp_path / "exported",
                            log=lambda line: None)
    for m in ("painter", "sketcher"):
        assert output_diff(spec, m, states[m], out / m) <= 1e-5, m
        assert json.loads((out / m / "projector.json").read_text())["connects"] == f"llm -> {m}"
    tokens = json.loads((out / "llm" / "tokens.json").read_text())
    assert tokens["special_tokens"]["more_gens"] == [262] and tokens["vocab_size"] == 263
