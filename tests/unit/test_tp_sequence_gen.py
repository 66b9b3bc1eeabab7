"""The generators on sequence slices (``models/diffusers_tp.py``, tensor parallelism with
sequence-sharded activations: the DiT's blocks, the U-Net's transformer blocks) compute the unsharded
model's output and gradients on two real gloo ranks, the condition's gradient included; the recipe
rules that let a generator ask for it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.attention import BasicTransformerBlock
from rank_pool import run_ranks  # tests/ is on sys.path under pytest
from saved_bytes import saved_bytes
from test_tp_sequence import REPO, tp_overlap_on
from tp_seq_cases import WORLD
from tp_seq_gen_cases import CASES, generator_case

from disttrain_ds.errors import ConfigError
from disttrain_ds.models.diffusers_tp import check_block
from disttrain_ds.parallel.tensor_parallel import TPContext
from disttrain_ds.parallel.tp_sequence import TPSeqContext
from disttrain_ds.recipe.schema import load_recipe

SLICED_DIT_GRAPHS = 7
"""Graphs of a compiled DiT block on slices, between its six collectives: the modulation, first norm
and q/k/v input; the self-attention; the gated residual; the cross-attention (keys and values of the condition); the
residual, second norm and modulation; the GELU; the gated residual."""


SLICED_UNET_DOWN_GRAPHS = 11
"""Graphs of the tiny U-Net's first down block (a ResNet, a transformer model of one block, a
downsampling convolution) compiled with its transformer model on slices: the ResNet; the slice, its
GroupNorm (the statistics' all-reduce traced into the graph) and input projection; then, between the
block's six collectives, the first norm, the self-attention, the residual and second norm, the
cross-attention, the residual and third norm, the GEGLU; the last residual; the output projection,
joined slices and residual; the downsampling."""


def _cases(rank: int, group, cases: list[tuple], hooks: bool) -> list[dict]:
    return [generator_case(rank, group, *c, hooks=hooks) for c in cases]


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_ranks(_cases, WORLD, CASES, True)


@pytest.mark.parametrize("i", range(len(CASES)), ids=["dit_tokens64_chunks3", "dit_tokens36_chunks1", "dit_one_image",
                                                      "unet_conv_projections", "unet_linear_projections_one_image"])
def test_generators_on_slices_give_the_unsharded_output_and_every_gradient(runs, i):
    family, resolution, _, images, _ = CASES[i]
    for rank in range(WORLD):
        got = runs[rank][i]
        if family == "dit":  # between blocks: this rank's slice of every image's tokens
            assert got["between"] == (images, (resolution // 2) ** 2 // WORLD, 32)
        else:  # between U-Net blocks: whole images (only the transformer blocks inside run on slices)
            assert got["between"] == (images, 16, resolution // 2, resolution // 2)
        # Each rank holds about half the weights: attention, MLPs and (in the U-Net) the ResNets'
        # convolutions split; embeddings, projections, heads and the U-Net's outer convolutions do not.
        assert 0.5 < got["param_share"] < 0.7, got["param_share"]
        assert got["contiguous"]  # what a pipeline stage can send
        assert got["out_err"] < 1e-5
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5, abs=1e-6)
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"
        assert got["cond_err"] < 1e-5  # what the output projector before the generator receives
        assert got["host_reads"] == ["__float__"]  # only the control's read of the loss, after the step


@pytest.mark.parametrize("i, replicated", [(0, ("scale_shift_table", "to_out.0.bias", "net.2.bias", "proj_out")),
                                            (3, ("norm", "proj_in", "proj_out", "to_out.0.bias", "net.2.bias"))],
                         ids=["dit", "unet"])
def test_generators_on_slices_without_summing_replicated_gradients_over_tp_get_them_wrong(i, replicated):
    runs = run_ranks(_cases, WORLD, CASES[i:i + 1], False)
    for rank in range(WORLD):
        got = runs[rank][0]
        assert got["out_err"] < 1e-5  # the forward is unaffected
        # the replicated parameters on slices: modulation table or norms, the row-parallel linears' biases,
        # the DiT's output projection, the U-Net transformer models' GroupNorm and projections
        assert got["grad_err"] > 1e-2 and any(k in got["where"] for k in replicated), got["where"]


def _compiled(rank: int, group, i: int) -> dict:
    return generator_case(rank, group, *CASES[i], backend="aot_eager")


@pytest.mark.parametrize("i, graphs", [(0, SLICED_DIT_GRAPHS), (3, SLICED_UNET_DOWN_GRAPHS)], ids=["dit", "unet"])
def test_compiled_generator_layers_on_slices_give_the_unsharded_output_and_every_gradient(i, graphs):
    runs = run_ranks(_compiled, WORLD, i)
    for rank in range(WORLD):
        got = runs[rank]
        assert got["out_err"] < 1e-5 and got["cond_err"] < 1e-5
        assert got["grad_err"] < 1e-5, f"rank {rank}: {got['where']} differs by {got['grad_err']:.2e}"
        assert got["graphs"] == graphs, got["graphs"]


def _group_norm_case(rank: int, group, offset: float) -> dict:
    """A GroupNorm over two images of 64 tokens x 32 channels (8 groups) whose values sit ``offset``
    from zero, from each rank's slice of the tokens, and the library's on whole images in float32;
    each one's worst error against the library's in float64 (relative to its largest value)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 64, 32, generator=g, dtype=torch.float64) + offset
    weight = torch.randn(2, 64, 32, generator=g, dtype=torch.float64)
    affine = torch.randn(2, 32, generator=g, dtype=torch.float64)
    own = slice(rank * 32, (rank + 1) * 32)

    def whole(dtype: torch.dtype) -> list[torch.Tensor]:  # output slice, input gradient slice, weight / bias grads
        inp, w, b = (t.to(dtype, copy=True).requires_grad_() for t in (x, *affine))
        out = F.group_norm(inp.transpose(1, 2), 8, w, b, 1e-5).transpose(1, 2)
        (out * weight.to(dtype)).sum().backward()
        return [out[:, own], inp.grad[:, own], w.grad, b.grad]

    norm = torch.nn.GroupNorm(8, 32)
    with torch.no_grad():
        norm.weight.copy_(affine[0])
        norm.bias.copy_(affine[1])
    part = x[:, own].float().requires_grad_()
    out = TPSeqContext(TPContext(group, rank, WORLD, 0)).group_norm(part, norm)
    (out * weight[:, own].float()).sum().backward()
    grads = [p.grad.clone() for p in norm.parameters()]
    for t in grads:  # each rank's share, as the TP hook sums them
        dist.all_reduce(t, group=group)
    local = F.group_norm(part.detach().transpose(1, 2), 8, norm.weight, norm.bias, norm.eps).transpose(1, 2)

    exact = whole(torch.float64)

    def err(got: list[torch.Tensor]) -> list[float]:
        return [float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, exact)]

    return {"ours": err([out, part.grad, *grads]), "library": err(whole(torch.float32)), "local": err([local])[0]}


@pytest.mark.parametrize("offset", [0.0, 1e3], ids=["centred", "far_from_zero"])
def test_group_norm_on_token_slices_normalises_by_whole_images_as_precisely_as_the_library(offset):
    for got in run_ranks(_group_norm_case, WORLD, offset).values():
        # output, input gradient, weight and bias gradients: within a few float32 roundings of the
        # exact values, as the library's own kernel on whole images (no variance lost to a large mean)
        for ours, library in zip(got["ours"], got["library"]):
            assert ours < 4 * library + 1e-6, got
        assert got["local"] > 1e-2  # control: the slice's own statistics are not the image's


def _group_norm_saved(rank: int, group) -> dict:
    """Bytes kept for backward by a bfloat16 GroupNorm on this rank's slice of 512 tokens and by the
    library's kernel on the same slice (its own statistics: the same tensors' sizes)."""
    part = torch.randn(2, 256, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = torch.nn.GroupNorm(8, 32).to(torch.bfloat16)
    ours, _ = saved_bytes(norm, lambda: TPSeqContext(TPContext(group, rank, WORLD, 0)).group_norm(part, norm))
    library, _ = saved_bytes(norm, lambda: norm(part.transpose(1, 2)))
    return {"ours": ours, "library": library, "input": part.numel() * part.element_size()}


def test_group_norm_on_token_slices_keeps_its_bfloat16_input_and_no_float32_copy_for_backward():
    for got in run_ranks(_group_norm_saved, WORLD).values():
        assert got["library"] >= got["input"]  # the library keeps its input (and [B, G] statistics)
        # ...and so do the slices, plus a few float32 per-channel vectors; a float32 copy of the
        # input (twice its bytes) would fail here.
        assert got["ours"] - got["library"] <= 8 * 2 * 32 * 4 < got["input"] // 4, got


def _two_gen(*overrides: str):
    """tiny_two_gen, whose ``sketcher`` is a DiT of 8 x 8 px at patch 2: 16 patch tokens per image."""
    return load_recipe(REPO / "recipes" / "tiny_two_gen.yaml", ["layout=disaggregated", *overrides])


def test_tp_overlap_auto_turns_on_for_a_dit_generator_on_cuda_where_its_tokens_split():
    r = _two_gen("parallel.modules.sketcher.tp=2")
    assert tp_overlap_on(r, "sketcher", cuda=True) and not tp_overlap_on(r, "sketcher", cuda=False)
    assert tp_overlap_on(_two_gen("parallel.modules.sketcher.tp=2", "parallel.modules.sketcher.tp_overlap=true"),
                         "sketcher", cuda=False)
    # At 6 x 6 px, 9 patch tokens do not split over 2 ranks: auto stays replicated, true is refused.
    odd = ("parallel.modules.sketcher.tp=2", "model.modules.sketcher.resolution=6")
    assert not tp_overlap_on(_two_gen(*odd), "sketcher", cuda=True)
    with pytest.raises(ConfigError, match=r"parallel\.modules\.sketcher\.tp_overlap.*tp 2 must divide the 9 tokens"):
        _two_gen(*odd, "parallel.modules.sketcher.tp_overlap=true")


def test_a_unet_whose_resnet_channels_or_norm_groups_do_not_split_over_tp_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.modules\.painter\.norm_num_groups"):
        _two_gen("parallel.modules.painter.tp=4", "model.modules.painter.norm_num_groups=2")
    with pytest.raises(ConfigError, match=r"model\.modules\.painter\.block_out_channels\[0\]"):
        _two_gen("parallel.modules.painter.tp=4", "model.modules.painter.block_out_channels=[18,32]",
                 "model.modules.painter.norm_num_groups=2", "model.modules.painter.attention_head_dim=[4,4]")


def test_a_transformer_block_the_sliced_forward_does_not_compute_is_refused_in_one_line():
    check_block(BasicTransformerBlock(16, 2, 8, cross_attention_dim=24, activation_fn="geglu"))  # the U-Net's
    odd = BasicTransformerBlock(16, 2, 8, cross_attention_dim=24, norm_type="ada_norm_zero", num_embeds_ada_norm=10)
    refusal = r"^transformer block on sequence slices: norm_type 'ada_norm_zero' not supported$"
    with pytest.raises(ValueError, match=refusal):
        check_block(odd)
