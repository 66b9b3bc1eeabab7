"""Ulysses sequence parallelism in the encoders computes the library layers' outputs and gradients
(fp32, gloo under NCCL's rules).

Every rank builds one family's seeded encoder layers (embedding, transformer layers, head) whole and
runs them on items of several sizes (images of three resolutions, audio clips of three durations),
whose packed rows do not divide by SP (padding is exercised); then the SP run: its slice of the
rows, the all-to-all around attention, the rows gathered at the head. The output equals the
reference's on every rank; the parameter gradients, averaged over the SP group as DeepSpeed's data
axis averages them, equal the reference's when the lead alone injects the output's gradient times
the SP factor (as the boundary does). Negative controls: the gradient without the SP factor,
attention across items, and an all-to-all whose gradient is not exchanged back, each caught.

Jobs: an encoder at ``parallel.<encoder>.sp: 2`` trains the reference's losses and parameters over 3
SGD steps, alone and composed with its DP, PP and TP, and an audio encoder beside an image one; only
its SP lead sends to the LLM, and only its ranks run all-to-alls.
"""

from __future__ import annotations

import json

import pytest
import torch

from disttrain_ds.families import FAMILIES
from disttrain_ds.families.base import BuildContext

from .conftest import max_param_mismatch
from .test_comm import run_ranks
from .test_sequence_parallel import _job, _topology

TOL = 1e-5
FAMILY_CONFIGS = {
    "vit": dict(hidden_size=32, heads=4, ffn_hidden=48, layers=2, patch_size=4, image_size=16),
    "clip": dict(hidden_size=32, heads=4, ffn_hidden=48, layers=3, patch_size=4, image_size=16),
    "siglip": dict(hidden_size=32, heads=4, ffn_hidden=48, layers=3, patch_size=4, image_size=16),
    "whisper": dict(n_mels=8, hidden_size=32, heads=4, ffn_hidden=48, layers=2, max_frames=40),
}


def _inputs(family: str):
    from disttrain_ds.models.packed import pack_clips
    from disttrain_ds.models.pixels import pack_images

    g = torch.Generator().manual_seed(3)
    if family == "whisper":  # 6 + 10 + 7 rows
        return pack_clips([torch.randn(8, n, generator=g) for n in (12, 20, 14)])
    # 16 x 16, 8 x 12 and 12 x 8 pixels: 16, 6 and 6 patches (plus a CLS each where the family has one)
    return pack_images([torch.randn(3, h, w, generator=g) for h, w in ((16, 16), (8, 12), (12, 8))])


def _layers(family: str):
    f = FAMILIES[family]
    cfg = f.config_type(family=family, **FAMILY_CONFIGS[family])
    return [d.build() for d in f.layers(cfg, BuildContext(module="encoder", seed=5, llm_hidden=32))]


def _forward(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _worker(rank: int, family: str, fault: str) -> dict:
    import torch.distributed as dist

    from disttrain_ds.models import packed_sp
    from disttrain_ds.parallel.sequence_parallel import SPContext, attach

    world = dist.get_world_size()
    inputs = _inputs(family)
    ref = _layers(family)
    ref_out = _forward(ref, inputs)
    weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(9))
    (ref_out * weight).sum().backward()

    if fault == "one_item":  # every row attends to every row: items no longer kept apart
        packed_sp.item_spans = lambda counts, size: counts.new_tensor([packed_sp.padded_rows(int(counts.sum()), size)])
    sp = SPContext(dist.new_group(list(range(world))), rank, world, lead=0, drop_grad=fault == "drop_grad")
    layers = [attach(layer, sp) for layer in _layers(family)]
    out = _forward(layers, inputs)
    factor = 1.0 if fault == "no_factor" else sp.grad_factor
    # The boundary: the lead injects the downstream gradient times the SP factor, the others zeros.
    (out * (weight * factor if sp.is_lead else torch.zeros_like(weight))).sum().backward()

    worst = {"out": float((out - ref_out).abs().max() / ref_out.abs().max())}
    ref_params = {f"{i}.{n}": p for i, layer in enumerate(ref) for n, p in layer.named_parameters()}
    # Each error relative to its gradient's scale, floored at 1% of the largest: a key bias's gradient
    # is zero up to rounding (softmax ignores a constant per row), so its noise is no scale of its own.
    floor = 0.01 * max(float(p.grad.abs().max()) for p in ref_params.values() if p.grad is not None)
    err = 0.0
    for i, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            want = ref_params[f"{i}.{n}"].grad
            if want is None:  # a frozen part (CLIP's unused final norm)
                continue
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=sp.group)
            g /= world
            err = max(err, float((g - want).abs().max() / want.abs().max().clamp_min(floor)))
    worst["params"] = err
    return worst


class _Worker:
    """Picklable ``fn(rank)`` for ``run_ranks``."""

    def __init__(self, family: str, fault: str):
        self.family, self.fault = family, fault

    def __call__(self, rank: int) -> dict:
        return _worker(rank, self.family, self.fault)


def _results(family: str, fault: str = "", world: int = 2) -> dict:
    out = run_ranks(world, _Worker(family, fault), timeout=180)
    bad = {r: v for r, v in out.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: v[1] for r, v in out.items()}


@pytest.mark.parametrize("family", [
    "vit", "whisper",
    pytest.param("clip", marks=pytest.mark.slow),  # the tower code SigLIP shares, with CLS and a pre-norm
    pytest.param("siglip", marks=pytest.mark.slow),  # a layer that keeps keyword arguments from its attention
])
def test_sp2_encoder_outputs_and_gradients_equal_the_library_layers(family):
    for rank, worst in _results(family).items():
        assert worst["out"] < TOL, (rank, worst)
        assert worst["params"] < TOL, (rank, worst)


@pytest.mark.slow
def test_sp4_splits_the_heads_one_per_rank():
    for rank, worst in _results("vit", world=4).items():
        assert worst["out"] < TOL and worst["params"] < TOL, (rank, worst)


@pytest.mark.parametrize("fault", ["no_factor", "one_item", "drop_grad"])
def test_sp2_encoder_faults_are_caught(fault):
    """A gradient without the SP factor, attention across items, a dropped all-to-all gradient."""
    worst = _results("vit", fault)
    assert max(max(w["out"], w["params"]) for w in worst.values()) > 1e-3, worst


@pytest.mark.slow  # the default tier pins the layers (with their negative controls) and the LLM's SP job
def test_encoder_sp2_job_trains_the_reference_and_only_its_lead_sends(tmp_path, reference_run):
    """The image encoder at SP 2 beside the LLM at PP 2: the reference's losses and parameters over 3
    SGD steps; the encoder's ranks exchange slices (the LLM's none); only its SP lead sends its rows."""
    overrides = ["parallel.encoder.sp=2"]
    _job("encoder_sp2", {"encoder_sp2": (5, overrides)}, tmp_path, reference_run, module="encoder")
    _exchanged_in(tmp_path, _topology(overrides), "encoder")


def _exchanged_in(out, topo, *modules: str) -> None:
    """Ranks of ``modules`` ran all-to-alls (those of a stage without attention need none), no
    other rank did."""
    ranks = {r for m in topo.modules if m.name in modules for r in m.ranks}
    a2a = {r: json.loads((out / f"a2a_rank{r}.json").read_text()) for m in topo.modules for r in m.ranks}
    assert any(a2a[r] for r in ranks) and not any(a2a[r] for r in a2a if r not in ranks), a2a


SLOW_JOBS = {
    # name: (ranks, overrides)
    "encoder_pp2_sp2": (7, ["parallel.encoder.sp=2", "parallel.encoder.pp=2"]),
    "encoder_tp2_sp2": (7, ["parallel.encoder.sp=2", "parallel.encoder.tp=2", "model.encoder.heads=4"]),
    "encoder_dp2_sp2": (7, ["parallel.encoder.sp=2", "parallel.encoder.dp=2", "train.micro_batch=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_JOBS))
def test_more_encoder_sp_jobs_train_the_reference(name, tmp_path, reference_run):
    _job(name, SLOW_JOBS, tmp_path, reference_run, module="encoder")
    _exchanged_in(tmp_path, _topology(SLOW_JOBS[name][1]), "encoder")


@pytest.mark.slow
def test_audio_encoder_at_sp2_beside_an_image_encoder_at_pp2_trains_the_reference(tmp_path, reference_run):
    """tiny_omni: the audio encoder (Whisper) at SP 2, the image encoder split in two stages."""
    from disttrain_ds.recipe.graph import topology_of
    from disttrain_ds.recipe.schema import load_recipe

    from .conftest import launch
    from .test_fidelity import SGD, STEPS

    overrides = ["parallel.modules.ear.sp=2", "parallel.modules.vision.pp=2"]
    rows, params, _ = launch(tmp_path, 7, [STEPS, *SGD, "layout=disaggregated", *overrides], recipe="tiny_omni")
    ref_losses, ref_params = reference_run([STEPS, *SGD], "tiny_omni")
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    _exchanged_in(tmp_path, topology_of(load_recipe("tiny_omni", ["layout=disaggregated", *overrides])), "ear")


# One square image per sample of 1, 16 or 64 patches; compute slow enough (1 TFLOP/s) and the
# all-to-alls fast enough (8 GB/s) that a 64-patch image beside small ones is split in two.
ADAPTIVE = ["parallel.llm.pp=1", "parallel.encoder.dp=4", "parallel.encoder.sp=auto", "parallel.sp_bandwidth_gbs=[8,8]",
            "train.peak_tflops=1", "data.image_sizes=[8,32,64]", "data.max_images=1", "data.resolution_sampler=square",
            "train.micro_batch=4", "model.encoder.heads=4"]


@pytest.mark.slow  # the default tier pins the groups (tests/unit/test_placement.py) and the LLM's adaptive job
def test_adaptive_encoder_sp_mixes_a_group_of_two_with_single_ranks_and_trains_the_reference(tmp_path, reference_run):
    """``parallel.encoder.sp: auto`` on 4 encoder ranks: the steps form one group of 4, then one of 2
    beside two ranks alone (twice); the reference's losses and parameters over 3 SGD steps; only the
    encoder's ranks run all-to-alls."""
    from .conftest import launch
    from .test_fidelity import SGD, STEPS

    rows, params, _ = launch(tmp_path, 6, [STEPS, *SGD, "layout=disaggregated", *ADAPTIVE])
    ref_losses, ref_params = reference_run([STEPS, *SGD, *(o for o in ADAPTIVE if not o.startswith("parallel."))])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    groups = [tuple(int(r.get(f"sp/encoder_groups_{s}", 0)) for s in (1, 2, 4)) for r in rows]
    assert groups == [(0, 0, 1), (2, 1, 0), (2, 1, 0)], groups
    _exchanged_in(tmp_path, _topology(ADAPTIVE), "encoder")


@pytest.mark.slow
def test_adaptive_encoder_sp_beside_a_post_balanced_generator_trains_the_reference(tmp_path, reference_run):
    """With ``parallel.post_balance`` the encoder's adaptive groups place its images (they balance by
    cost themselves) while the generator's 2 replicas take targets by cost."""
    from .conftest import launch
    from .test_fidelity import SGD, STEPS

    overrides = [*ADAPTIVE, "parallel.generator.dp=2", "parallel.post_balance=true", "data.gen_images=[0,2]"]
    rows, params, _ = launch(tmp_path, 7, [STEPS, *SGD, "layout=disaggregated", *overrides])
    ref_losses, ref_params = reference_run([STEPS, *SGD, *(o for o in overrides if not o.startswith("parallel."))])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e} (relative to its scale)"
    assert any(r.get("sp/encoder_groups_2", 0) for r in rows), rows
