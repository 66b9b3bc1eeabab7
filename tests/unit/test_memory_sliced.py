"""The memory estimate of an LLM, an encoder or a generator on sequence slices (tensor parallelism
with ``tp_overlap``): what real sliced decoder, ViT, Whisper, DiT and U-Net blocks keep for backward on two
gloo ranks against their formulas' ``LayerBytes.sliced``, and the estimate and the planner's stage
tables following the layout that runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_pool import run_ranks  # tests/ is on sys.path under pytest
from saved_bytes import saved_bytes  # tests/ is on sys.path under pytest
from tp_seq_cases import VOCAB, WORLD, B, S, config, layer_defs  # tests/ is on sys.path under pytest
from tp_seq_gen_cases import CHANNELS, COND, CROSS, generator_defs
from tp_seq_gen_cases import config as gen_config

from disttrain_ds.comm import overlap
from disttrain_ds.cost.activations import SampleShape
from disttrain_ds.estimate import memory
from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.dit.estimates import activation_layers as dit_activations
from disttrain_ds.families.dit.model import dit_layers
from disttrain_ds.families.llama.estimates import decoder_activations
from disttrain_ds.families.unet.estimates import activation_layers as unet_activations
from disttrain_ds.families.vit.config import EncoderConfig
from disttrain_ds.families.vit.estimates import encoder_activations
from disttrain_ds.families.vit.model import encoder_layers
from disttrain_ds.families.whisper.config import AudioEncoderConfig
from disttrain_ds.families.whisper.estimates import activation_layers
from disttrain_ds.families.whisper.model import encoder_layers as whisper_layers
from disttrain_ds.models.layers import as_tuple
from disttrain_ds.models.packed import pack_clips
from disttrain_ds.models.pixels import pack_images
from disttrain_ds.parallel.tensor_parallel import TPContext, shard_layer
from disttrain_ds.parallel.tp_sequence import TPSeqContext, attach
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]


VIT = EncoderConfig(hidden_size=32, layers=2, heads=4, ffn_hidden=64, patch_size=8, image_size=32)
IMAGES = 4
"""Images of 16 x 16 px in the ViT runs: 4 patches and a CLS token each, 20 rows (10 per slice)."""
WHISPER = AudioEncoderConfig(n_mels=8, hidden_size=32, layers=2, heads=4, ffn_hidden=64, max_frames=40)
CLIPS = 4
"""Clips of 10 log-mel frames in the Whisper runs: 5 rows each, 20 rows (10 per slice)."""
DIT = gen_config("dit", 16)
GEN_IMAGES = 3
"""Images of 16 x 16 px in the DiT and U-Net runs (DiT: 64 patch tokens each, 32 per slice), a condition of 5 tokens."""
UNET = gen_config("unet", 16)


def _generator_inputs(g: torch.Generator) -> tuple:
    """(condition, noisy images of 16 x 16 px, timesteps) of the generator runs."""
    return (torch.randn(GEN_IMAGES, COND, CROSS, generator=g), torch.randn(GEN_IMAGES, CHANNELS, 16, 16, generator=g),
            torch.randint(0, 1000, (GEN_IMAGES,), generator=g))


def _per_layer(layers, inputs, gathered: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Bytes each layer keeps for backward (parameters excluded, each storage once, plus what
    ``gathered`` collects while it runs) and its output bytes, the layers run one after another."""
    x, saved, outputs = inputs, [], []
    for layer in layers:
        x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in as_tuple(x))
        if gathered is not None:
            gathered.clear()
        n, x = saved_bytes(layer, lambda: layer(x))
        saved.append(n + sum(gathered or ()))
        outputs.append(sum(t.numel() * t.element_size() for t in as_tuple(x) if t.is_floating_point()))
    return saved, outputs


def _kept(rank: int, group, family: str) -> dict:
    """Bytes each layer keeps for backward (parameters excluded, each storage once, and the
    gathered inputs the overlapped column GEMMs keep on their autograd context) and each layer's
    output bytes, replicated and on slices."""
    gathered: list[int] = []
    forward = overlap._AllGatherMatmul.forward

    def counting(ctx, *args):
        out = forward(ctx, *args)
        gathered.extend(b.untyped_storage().nbytes() for b in ctx.bufs or ())
        return out

    overlap._AllGatherMatmul.forward = staticmethod(counting)
    tp = TPContext(group, rank, WORLD, 0)
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        defs = encoder_layers(VIT, BuildContext(module="encoder", seed=3, llm_hidden=32))
        inputs = pack_images([torch.randn(3, 16, 16, generator=g) for _ in range(IMAGES)])
    elif family == "whisper":
        defs = whisper_layers(WHISPER, BuildContext(module="encoder", seed=3, llm_hidden=32))
        inputs = pack_clips([torch.randn(8, 10, generator=g) for _ in range(CLIPS)])
    elif family in ("dit", "unet"):
        defs = (dit_layers(DIT, BuildContext(module="generator", seed=3, llm_hidden=32)) if family == "dit"
                else generator_defs("unet", 16))
        inputs = _generator_inputs(g)
    else:
        defs = layer_defs(family, {})
        ids = torch.randint(0, VOCAB - 1, (B, S), generator=g)
        inputs = (ids, torch.zeros(0, 32), torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 5]))
    out = {}
    for mode in ("replicated", "sliced"):
        layers = [shard_layer(d.build(), tp) for d in defs]
        if mode == "sliced":
            layers = [attach(layer, TPSeqContext(tp, 2)) for layer in layers]
        out[mode] = _per_layer(layers, inputs, gathered)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sliced_blocks_keep_what_the_formula_takes_off_the_replicated_layout(family):
    runs = run_ranks(_kept, WORLD, family)
    lb = decoder_activations(config(family, {}), SampleShape(tokens=S, images=0, patches=0, gen_images=1), 4)
    # The formula is per sample, a row of S tokens; the runs hold B rows.
    want = [B * (r - s) for r, s in zip(lb.on_rank(WORLD), lb.on_rank(WORLD, sliced=True))]
    for rank in range(WORLD):
        (rep, rep_out), (cut, cut_out) = runs[rank]["replicated"], runs[rank]["sliced"]
        got = [r - c for r, c in zip(rep, cut)]
        assert got == pytest.approx(want, rel=1e-9, abs=0.5)  # the blocks keep less; embedding and head as before
        # Control: the blocks keep a tenth less and more, so a formula blind to slices fails above.
        assert min(got[1:-1]) > 0.1 * max(rep[1:-1])
        # Between layers a rank passes on its slice (embedding, blocks); the head joins them.
        assert cut_out == pytest.approx([B * o for o in lb.outputs_on_rank(WORLD, sliced=True)], rel=1e-9)
        assert cut_out[:-1] == [o // WORLD for o in rep_out[:-1]] and cut_out[-1] == rep_out[-1]


@pytest.mark.parametrize("family", ["vit", "whisper"])
def test_sliced_encoder_blocks_keep_what_the_formula_takes_off_the_replicated_layout(family):
    runs = run_ranks(_kept, WORLD, family)
    # One sample holding every item of the run (the formula's projector layer is not built here).
    if family == "vit":
        lb = encoder_activations(VIT, 32, SampleShape(tokens=0, images=IMAGES, patches=4 * IMAGES, gen_images=0), 4)
    else:
        lb = activation_layers(WHISPER, 32, SampleShape(tokens=0, images=0, patches=0, gen_images=0,
                                                        audio_rows=5 * CLIPS), 4)
    want = [r - s for r, s in zip(lb.on_rank(WORLD), lb.on_rank(WORLD, sliced=True))][:-1]
    for rank in range(WORLD):
        (rep, rep_out), (cut, cut_out) = runs[rank]["replicated"], runs[rank]["sliced"]
        got = [r - c for r, c in zip(rep, cut)]
        assert got == pytest.approx(want, rel=1e-9, abs=0.5)
        assert min(got[1:-1]) > 0.05 * max(rep[1:-1])  # control: a formula blind to slices fails above
        assert cut_out == pytest.approx(lb.outputs_on_rank(WORLD, sliced=True)[:-1], rel=1e-9)
        assert cut_out[:-1] == [o // WORLD for o in rep_out[:-1]] and cut_out[-1] == rep_out[-1]  # slices, then whole


@pytest.mark.parametrize("family", ["dit", "unet"])
def test_sliced_generator_blocks_keep_what_the_formula_takes_off_the_replicated_layout(family):
    runs = run_ranks(_kept, WORLD, family)
    formula = dit_activations if family == "dit" else unet_activations
    lb = formula(DIT if family == "dit" else UNET, 32,
                 SampleShape(tokens=0, images=0, patches=0, gen_images=GEN_IMAGES), 4)
    want = [r - s for r, s in zip(lb.on_rank(WORLD), lb.on_rank(WORLD, sliced=True))][1:]  # no projector here
    # A U-Net transformer model's GroupNorm on slices keeps (3 x groups + channels) float32 statistics
    # per image more than the library's kernel (per-rank moments, scale): uncounted, a few hundred bytes.
    stats = 0.5 if family == "dit" else 2 * GEN_IMAGES * 4 * (3 * UNET.norm_num_groups + max(UNET.block_out_channels))
    for rank in range(WORLD):
        (rep, rep_out), (cut, cut_out) = runs[rank]["replicated"], runs[rank]["sliced"]
        got = [r - c for r, c in zip(rep, cut)]
        assert got == pytest.approx(want, rel=1e-9, abs=stats)
        assert cut_out == pytest.approx(lb.outputs_on_rank(WORLD, sliced=True)[1:], rel=1e-9)
        if family == "dit":
            assert min(got[1:-1]) > 0.1 * max(rep[1:-1])  # control: a formula blind to slices fails above
            # Tokens pass on as slices beside the whole condition and modulation; the head joins them.
            tokens = GEN_IMAGES * 64 * 32 * 4
            assert [r - c for r, c in zip(rep_out, cut_out)] == [tokens // WORLD] * 3 + [0]
        else:
            # Control: the layers with transformer blocks (first down, mid, last up) keep less on slices.
            assert [g > 0.02 * r for g, r in zip(got, rep)] == [False, True, False, True, False, True, False]
            assert cut_out == rep_out  # between layers the images are whole


def _kept_by_degree(rank: int, group, overrides: dict) -> dict[int, list[int]]:
    """Bytes each layer of the tiny U-Net (``overrides`` on its config) keeps for backward, whole
    (TP 1) and on one of two TP ranks (activations replicated)."""
    defs, inputs = generator_defs("unet", 16, overrides), _generator_inputs(torch.Generator().manual_seed(1))
    out = {}
    for size in (1, WORLD):
        tp = TPContext(group if size > 1 else None, rank if size > 1 else 0, size, 0)
        out[size] = _per_layer([shard_layer(d.build(), tp) for d in defs], inputs)[0]
    return out


NO_ATTENTION = {"down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"]}


@pytest.mark.parametrize("overrides", [NO_ATTENTION, {}], ids=["resnets_only", "with_attention"])
def test_a_unet_at_tp2_keeps_what_the_formula_says_tp_splits(overrides):
    runs = run_ranks(_kept_by_degree, WORLD, overrides)
    lb = unet_activations(gen_config("unet", 16, overrides), 32,
                          SampleShape(tokens=0, images=0, patches=0, gen_images=GEN_IMAGES), 4)
    want = [w - t for w, t in zip(lb.on_rank(1), lb.on_rank(WORLD))][1:]  # no projector here
    assert max(want) > 0  # control: a formula that splits nothing fails below
    for rank in range(WORLD):
        got = [w - t for w, t in zip(runs[rank][1], runs[rank][WORLD])]
        # The ResNets' second halves and the transformer blocks' column-parallel outputs, bar each
        # ResNet's time-embedding rows (a few hundred bytes, uncounted).
        assert got == pytest.approx(want, abs=4 * 32 * GEN_IMAGES)
        assert all(g >= w for g, w in zip(got, want))


def _llm_activation_bytes(overrides: list[str], cuda: bool) -> float:
    recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["layout=disaggregated", "parallel.llm.tp=2", *overrides])
    return max(r.activations for r in memory.estimate(recipe, cuda=cuda) if r.module == "llm")


def test_the_estimate_counts_slices_where_the_llm_runs_on_them():
    sliced = _llm_activation_bytes([], cuda=True)  # tp_overlap auto: slices on CUDA
    assert sliced < _llm_activation_bytes([], cuda=False)  # ...replicated on the CPU
    assert sliced == _llm_activation_bytes(["parallel.llm.tp_overlap=true"], cuda=False)
    assert _llm_activation_bytes(["parallel.llm.tp_overlap=false"], cuda=True) == _llm_activation_bytes([], cuda=False)


def _encoder_activation_bytes(overrides: list[str], cuda: bool) -> float:
    recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml",
                         ["layout=disaggregated", "parallel.encoder.tp=2", *overrides])
    return max(r.activations for r in memory.estimate(recipe, cuda=cuda) if r.module == "encoder")


def test_the_estimate_counts_slices_where_the_vit_runs_on_them():
    sliced = _encoder_activation_bytes([], cuda=True)
    assert sliced < _encoder_activation_bytes([], cuda=False)
    assert sliced == _encoder_activation_bytes(["parallel.encoder.tp_overlap=true"], cuda=False)


def _generator_activation_bytes(name: str, overrides: list[str], cuda: bool) -> float:
    recipe = load_recipe(REPO / "recipes" / "tiny_two_gen.yaml",
                         ["layout=disaggregated", f"parallel.modules.{name}.tp=2", *overrides])
    return max(r.activations for r in memory.estimate(recipe, cuda=cuda) if r.module == name)


@pytest.mark.parametrize("name", ["sketcher", "painter"])  # the DiT, the U-Net
def test_the_estimate_counts_slices_where_a_generator_runs_on_them(name):
    sliced = _generator_activation_bytes(name, [], cuda=True)
    assert sliced < _generator_activation_bytes(name, [], cuda=False)
    assert sliced == _generator_activation_bytes(name, [f"parallel.modules.{name}.tp_overlap=true"], cuda=False)
