"""Memory estimate: activation formulas against real saved tensors, per-parameter bytes, the dry
run (``--dry-run``) and the check a real run makes before building anything."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from saved_bytes import saved_bytes  # tests/ is on sys.path under pytest

from disttrain_ds.cli.train import build_parser, main
from disttrain_ds.errors import ConfigError
from disttrain_ds.estimate import activations, memory, memory_check
from disttrain_ds.families.llama.estimates import decoder_activations
from disttrain_ds.families.unet.estimates import activation_layers as unet_layers
from disttrain_ds.families.vit.estimates import encoder_activations
from disttrain_ds.mllm.model import BatchNorms, collate, generator_states, llm_inputs
from disttrain_ds.models.objectives import gen_condition, lm_loss_sum
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.entry import run

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


def _leaf(x):
    if isinstance(x, tuple):
        return tuple(_leaf(t) for t in x)
    return x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x


def _measure(spec, module: str, inputs, head=None) -> tuple[list[int], object]:
    """Saved bytes of each pipeline layer of ``module`` on ``inputs``, and the module's output."""
    out, sizes, defs = inputs, [], spec.layers(module)
    for i, d in enumerate(defs):
        layer, x = d.build(), _leaf(out)
        last = i == len(defs) - 1
        n, out = saved_bytes(layer, (lambda: head(layer(x))) if last and head else (lambda: layer(x)))
        sizes.append(n)
    return sizes, out


@pytest.mark.parametrize("overrides", [
    [],
    ["model.generator.block_out_channels=[16,32,32]", "model.generator.resolution=32",
     "model.generator.down_block_types=[CrossAttnDownBlock2D,CrossAttnDownBlock2D,DownBlock2D]",
     "model.generator.up_block_types=[UpBlock2D,CrossAttnUpBlock2D,CrossAttnUpBlock2D]",
     "model.generator.attention_head_dim=[2,4,4]", "model.generator.layers_per_block=2",
     "model.llm.hidden_size=96", "model.llm.heads=6", "model.llm.kv_heads=3", "model.encoder.heads=4"],
])
def test_activation_formulas_match_saved_tensors_of_real_layers(overrides):
    from disttrain_ds.runtime.setup import build_data_and_spec

    recipe = load_recipe(TINY, ["train.global_batch=1", *overrides])
    source, spec = build_data_and_spec(recipe)
    sample = source.global_batch(0)[0]
    source.close()
    sample.labels[:] = 1  # every position labelled: the LM loss's worst case, as estimated
    mb = collate([sample], BatchNorms.of([sample], 1), spec)
    p = recipe.model.encoder.patch_size
    shape = activations.SampleShape(
        tokens=recipe.data.seq_len, images=len(sample.images),
        patches=sum((im.shape[1] // p) * (im.shape[2] // p) for im in sample.images),
        gen_images=max(1, sample.gen_targets[0].shape[0]))
    m, b = recipe.model, 4
    est = {"encoder": encoder_activations(m.encoder, m.llm.hidden_size, shape, b).saved,
           "llm": decoder_activations(spec.llm, shape, b).saved,
           "generator": unet_layers(m.generator, m.llm.hidden_size, shape, b).saved}
    got = {}
    got["encoder"], embeds = _measure(spec, "encoder", (mb.pixels, mb.image_hw))
    got["llm"], out = _measure(spec, "llm", llm_inputs(mb, embeds),
                               head=lambda o: (lm_loss_sum(o[0], mb.labels, mb.lm_scale), o[1]))
    g = mb.gens["generator"]
    states = generator_states(gen_condition(out[1], g.mask, spec.config("generator").query_tokens), mb, "generator")
    got["generator"], _ = _measure(spec, "generator", (states, g.noisy, g.timesteps))
    for module in est:
        assert len(est[module]) == len(got[module])
        assert sum(est[module]) == pytest.approx(sum(got[module]), rel=0.06), module


T2I_DIT = """\
name: t2i_dit
model:
  modules:
    llm: {family: llama, preset: tiny}
    painter: {family: dit, preset: tiny}
data: {seq_len: 128, max_images: 0, image_sizes: [16]}
deepspeed_config: ds_configs/cpu_fp32.json
"""


@pytest.mark.parametrize("overrides", [
    [],
    [f"model.modules.painter.{k}" for k in ("heads=4", "head_dim=16", "layers=3", "resolution=32", "patch_size=4",
                                            "query_tokens=7", "cross_attention_dim=48", "learn_sigma=true")],
])
def test_dit_activation_formula_matches_saved_tensors_of_real_layers(tmp_path, overrides):
    from disttrain_ds.recipe.graph import module_family
    from disttrain_ds.runtime.setup import build_data_and_spec

    path = tmp_path / "t2i_dit.yaml"
    path.write_text(T2I_DIT.replace("ds_configs/", f"{REPO}/ds_configs/"))
    recipe = load_recipe(str(path), ["train.global_batch=1", *overrides])
    source, spec = build_data_and_spec(recipe)
    sample = source.global_batch(0)[0]
    source.close()
    mb = collate([sample], BatchNorms.of([sample], 1), spec)
    shape = activations.SampleShape(tokens=recipe.data.seq_len, images=0, patches=0,
                                     gen_images=max(1, sample.gen_targets[0].shape[0]))
    g = recipe.model.generator
    est = module_family(recipe, "painter").activation_layers(g, recipe.model.llm.hidden_size, shape, 4)
    _, out = _measure(spec, "llm", llm_inputs(mb, torch.zeros(0, spec.llm.hidden_size)))
    gi = mb.gens["painter"]
    states = generator_states(gen_condition(out[1], gi.mask, g.query_tokens), mb, "painter")
    got, pred = _measure(spec, "painter", (states, gi.noisy, gi.timesteps))
    assert len(est.saved) == len(got) == len(est.outputs) == len(spec.layers("painter"))
    assert sum(est.saved) == pytest.approx(sum(got), rel=0.06)
    assert est.outputs[-1] == pred.numel() * 4 * shape.gen_images / pred.shape[0]
    # The estimate the memory check reads is this formula's.
    assert activations.module_layers(recipe, "painter", spec.llm.vocab_size) == est


@pytest.mark.parametrize("dtype, ds, optim, frozen, expected", [
    ("fp32", "ds_configs/cpu_fp32.json", "adamw", False, (4, 4, 8, False)),
    ("fp32", "ds_configs/zero1.json", "adamw", False, (4, 4, 16, True)),
    ("bf16", "ds_configs/zero1.json", "adamw", False, (2, 2, 16, True)),
    ("bf16", "ds_configs/cpu_fp32.json", "adamw", False, (2, 6, 12, True)),
    ("fp32", "ds_configs/cpu_fp32.json", "sgd", False, (4, 4, 0, False)),
    ("bf16", "ds_configs/zero1.json", "adamw", True, (2, 0, 0, False)),
])
def test_bytes_per_parameter_follow_dtype_zero_stage_optimizer_and_frozen(dtype, ds, optim, frozen, expected):
    recipe = load_recipe(TINY, ["layout=disaggregated", f"train.dtype={dtype}", f"deepspeed_config={ds}",
                                f"optim.name={optim}", f"model.llm.frozen={str(frozen).lower()}"])
    assert memory.state_bytes(recipe, "llm") == expected


def test_parameter_counts_on_meta_match_the_built_model(tiny_spec, tiny_recipe):
    counts = memory.layer_params(tiny_recipe, "llm", tiny_spec.llm.vocab_size)
    built = [sum(p.numel() for p in d.build().parameters()) for d in tiny_spec.layers("llm")]
    assert counts == built
    assert memory.vocab_size(tiny_recipe) == tiny_spec.llm.vocab_size


def test_stages_split_layers_and_in_flight_microbatches_follow_1f1b():
    recipe = load_recipe(TINY, ["layout=disaggregated", "train.global_batch=8"])
    rows = memory.estimate(recipe)
    assert [(r.module, r.stage, list(r.ranks)) for r in rows] == [
        ("encoder", 0, [0]), ("llm", 0, [1]), ("llm", 1, [2]), ("generator", 0, [3])]
    assert [r.in_flight for r in rows] == [4, 3, 2, 1]  # min(stages after it, microbatches)
    llm = [r for r in rows if r.module == "llm"]
    assert llm[0].layers.stop == llm[1].layers.start and llm[1].layers.stop == 6  # embed, 4 blocks, head


def test_optimizer_states_shard_over_data_parallel_ranks_under_zero1():
    base = ["layout=disaggregated", "parallel.llm.pp=1", "deepspeed_config=ds_configs/zero1.json"]
    one = {r.module: r for r in memory.estimate(load_recipe(TINY, base))}
    two = {r.module: r for r in memory.estimate(load_recipe(TINY, [*base, "parallel.llm.dp=2"]))}
    assert two["llm"].optimizer == pytest.approx(one["llm"].optimizer / 2)
    assert two["llm"].weights == one["llm"].weights and len(two["llm"].ranks) == 2


def test_parser_accepts_dry_run_anywhere():
    args = build_parser().parse_intermixed_args(["--recipe", "tiny_cpu", "layout=disaggregated", "--dry-run"])
    assert args.dry_run and args.overrides == ["layout=disaggregated"]


def test_dry_run_prints_every_rank_and_exits_0_for_tiny(run_main):
    code, out, err = run_main(main, "--recipe", TINY, "--dry-run", "layout=disaggregated", "parallel.llm.pp=3")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert sorted(int(r[0]) for r in rows if r[1] in ("encoder", "llm", "generator")) == list(range(5))
    assert "layout disaggregated: 5 ranks" in out and "fits" in out.splitlines()[-1]


def test_dry_run_of_a_recipe_that_cannot_fit_exits_2_naming_rank_and_module(run_main):
    code, out, err = run_main(main, "--recipe", "mllm_9b", "--dry-run", "layout=reference",
                              "train.device_memory_gib=80")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "rank 0 (llm" in err and "> 80.0 GiB (train.device_memory_gib)" in err and "Traceback" not in err
    assert "+ allowance " in err and "(context " in err  # a GPU's memory: what is not tensors counts too
    assert "rank 0" in out  # the table still came first


def test_dry_run_names_the_stage_rank_that_does_not_fit(run_main):
    code, _, err = run_main(main, "--recipe", TINY, "--dry-run", "layout=disaggregated",
                            "train.device_memory_gib=0.005")
    assert code == 2
    assert "rank 3 (generator stage 0)" in err and err.count("\n") == 1


def test_a_real_run_that_does_not_fit_stops_before_building_anything(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"rank 0 \(generator .* MiB of it, with encoder and llm"):
        run(TINY, ["train.device_memory_gib=0.001", f"logging.dir={run_dir}"])
    assert not run_dir.exists()


def test_device_limit_comes_from_the_recipe_or_this_machine(tiny_recipe):
    assert memory_check.device_limit_gib(dataclasses.replace(
        tiny_recipe, train=dataclasses.replace(tiny_recipe.train, device_memory_gib=80.0)), 4) == (
        80.0, "train.device_memory_gib")
    if not torch.cuda.is_available():
        one, _ = memory_check.device_limit_gib(tiny_recipe, 1)
        four, source = memory_check.device_limit_gib(tiny_recipe, 4)
        assert 0 < four < one and "host RAM" in source


def test_negative_device_memory_is_refused():
    with pytest.raises(ConfigError, match="'train.device_memory_gib' must be >= 0"):
        load_recipe(TINY, ["train.device_memory_gib=-1"])


def test_activation_checkpointing_keeps_block_inputs_and_recomputes_one_block():
    lb = activations.LayerBytes(saved=[10.0, 20.0, 30.0, 40.0, 50.0], outputs=[1.0, 2.0, 3.0, 4.0, 5.0], inputs=0.5)
    # Stage of layers 1..4 (received: layer 0's output), blocks of 2 from the stage's first layer.
    assert memory._stage_activations(lb, 1, 5) == (20 + 30 + 40 + 50 + 1.0 + 5.0, 50.0)
    kept, work = memory._stage_activations(lb, 1, 5, every=2)
    assert kept == 1.0 + 3.0 + 5.0  # received (block 1's input), block 2's input (layer 2's output), output
    assert work == (40 + 50) + 50  # the largest block recomputed, plus one layer's gradients
    assert memory._stage_activations(lb, 0, 5, every=5) == (0.5 + 5.0, 150.0 + 50)


def test_estimate_follows_each_modules_activation_checkpointing():
    base = ["layout=disaggregated", "train.global_batch=8"]
    off = {(r.module, r.stage): r for r in memory.estimate(load_recipe(TINY, base))}
    on = {(r.module, r.stage): r for r in memory.estimate(load_recipe(TINY, [*base, "parallel.llm.activation_checkpointing=1"]))}
    for key, row in off.items():
        if key[0] == "llm":
            assert 0 < on[key].activations < row.activations
        else:
            assert on[key].activations == row.activations
        assert (on[key].weights, on[key].grads) == (row.weights, row.grads)


def test_negative_activation_checkpointing_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"'parallel.llm.activation_checkpointing' must be >= 0"):
        load_recipe(TINY, ["parallel.llm.activation_checkpointing=-1"])
