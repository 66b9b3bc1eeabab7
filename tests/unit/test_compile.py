"""Compiled training (``models/compiled.py``, ``train.compile``) and the hot path without host reads:
graphs per layer family pinned, compiled = eager, recompiles bounded, host reads per microbatch
independent of depth, a loss that reads nothing back."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from host_reads import host_reads  # tests/ is on sys.path under pytest
from torch import nn
from torch._dynamo.testing import CompileCounter

from disttrain_ds.errors import ConfigError
from disttrain_ds.mllm.model import BatchNorms, ReferenceMLLM, collate
from disttrain_ds.models import doc_mask
from disttrain_ds.models.compiled import compile_enabled, compile_layers, compile_targets, graphs_compiled
from disttrain_ds.models.layers import Sequential
from disttrain_ds.models.objectives import lm_loss_sum
from disttrain_ds.models.vae import generator_vae
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime.setup import build_data_and_spec
from disttrain_ds.samples import IGNORE_INDEX, doc_ids

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]

GRAPHS = {
    # Layers that loop on the host (embeddings of items of several sizes) or hold nothing worth a
    # graph compile nothing; a decoder block on the span path breaks around its span attention
    # (which loops over the microbatch's span lengths) into 4 graphs, on whole rows it is one.
    "VitEmbed": 0, "VitBlock": 1, "VitHead": 0, "InputProjector": 1,
    "WhisperEmbed": 0, "WhisperBlock": 2, "WhisperHead": 0,
    "LlmEmbed": 0, "LlmBlock": 4, "LlmHead": 1,
    "ConditionProjector": 1, "UnetIn": 1, "UnetDown": 1, "UnetMid": 1, "UnetUp": 1, "UnetOut": 1,
    "DiTIn": 1, "DiTBlock": 1, "DiTOut": 1,
}
"""Graphs torch.compile makes of the first layer of each family on one microbatch (forward and
backward; the family's other layers reuse them where their shapes agree)."""


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model_and_batch(recipe: str, sample: int = 0):
    source, spec = build_data_and_spec(load_recipe(REPO / "recipes" / recipe))
    samples = source.global_batch(sample)[:1]
    mb = collate(samples, BatchNorms.of(samples, 1, len(spec.generators)), spec, dtype=torch.float32,
                 vae=generator_vae(spec))
    return spec, ReferenceMLLM(spec), mb, source


# tiny_omni holds every family of tiny_cpu and tiny_two_gen but the DiT, compiled alone on tiny_two_gen.
@pytest.mark.parametrize("recipe, modules", [("tiny_omni.yaml", None), ("tiny_two_gen.yaml", {"sketcher"})])
def test_each_layer_family_compiles_into_its_pinned_number_of_graphs(recipe, modules):
    spec, model, mb, _ = _model_and_batch(recipe)
    counts: dict[tuple[str, int], tuple[str, CompileCounter]] = {}
    for name in spec.names:
        if modules is not None and name not in modules:
            continue
        for i, layer in enumerate(getattr(model, name).layers):
            counter = CompileCounter()
            compile_layers([layer], backend=counter)
            counts[(name, i)] = (type(layer).__name__, counter)
    model(mb)["loss"].backward()
    seen: dict[str, int] = {}
    for kind, c in counts.values():  # the family's first layer makes its graphs; the others reuse them
        seen.setdefault(kind, c.frame_count)
    assert seen == {kind: GRAPHS[kind] for kind in seen}, seen


def test_graph_counting_sees_a_break():
    # Negative control of the pins above: a host read inside a layer is a graph break.
    class Reads(nn.Module):
        def forward(self, x):
            n = int(x.sum())
            return x * 2 + n

    counter = CompileCounter()
    compile_layers([Reads()], backend=counter)
    layer = Reads()
    compile_layers([layer], backend=counter)
    layer(torch.ones(3))
    assert counter.frame_count == 2


def _llm(spec, blocks: int) -> Sequential:
    spec = spec.with_changes("llm", layers=blocks)
    return Sequential([d.build() for d in spec.layers("llm")])


def test_a_block_on_rows_of_one_whole_document_is_one_graph(tiny_spec):
    llm = _llm(tiny_spec, 2)
    counter = CompileCounter()
    compile_layers(llm.layers[1:2], backend=counter)
    ids = torch.randint(0, 200, (2, 16))
    llm((ids, torch.zeros(0, tiny_spec.llm.hidden_size), torch.zeros(2, 16, dtype=torch.long)))[0].sum().backward()
    assert counter.frame_count == 1


def test_new_lengths_recompile_once_then_reuse_dynamic_graphs(tiny_spec):
    llm = _llm(tiny_spec, 2)
    counter = CompileCounter()
    compile_layers(llm.layers[1:], backend=counter)
    made = []
    for s in (16, 24, 32, 40, 48):  # every length a new shape, documents packed two per row
        docs = torch.stack([doc_ids((s // 2, s - s // 2), s)])
        ids = torch.randint(0, 200, (1, s))
        llm((ids, torch.zeros(0, tiny_spec.llm.hidden_size), docs))[0].sum().backward()
        made.append(counter.frame_count)
    # The first length compiles static graphs, the second recompiles them dynamic, then none.
    assert made[2] == made[3] == made[4] == made[1] > made[0] > 0, made


# Inductor generates and builds C++ for every kernel (minutes on two cores with a cold cache): the
# slow tier runs it, the default tier the same graphs through AOTAutograd without code generation.
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_layers_train_as_the_eager_ones_do_with_the_same_parameter_names(backend):
    spec, model, mb, source = _model_and_batch("tiny_cpu.yaml")
    _, eager, _, _ = _model_and_batch("tiny_cpu.yaml")
    eager.load_state_dict(model.state_dict())
    before = graphs_compiled()
    compile_layers((layer for name in spec.names for layer in getattr(model, name).layers), backend=backend)
    assert list(model.state_dict()) == list(eager.state_dict())
    out, ref = model(mb), eager(mb)
    out["loss"].backward()
    ref["loss"].backward()
    assert graphs_compiled() > before
    torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Negative control: one weight nudged by 1e-3 moves the loss past that tolerance.
    with torch.no_grad():
        next(eager.llm.parameters()).add_(1e-3)
    assert (eager(mb)["loss"] - out["loss"]).abs() > 1e-5


def _host_reads(spec, blocks: int, reset_each_block: bool = False) -> int:
    llm = _llm(spec, blocks)
    if reset_each_block:  # the control: every block builds its attention arguments anew
        for layer in llm.layers[1:-1]:
            layer.register_forward_pre_hook(lambda *_: setattr(doc_mask, "_LAST", ()))
    docs = torch.stack([doc_ids((5, 7, 4), 20), doc_ids((20,), 20)])
    ids = torch.randint(0, 200, (2, 20))
    labels = torch.randint(0, 200, (2, 20))
    with host_reads() as calls:
        logits, _ = llm((ids, torch.zeros(0, spec.llm.hidden_size), docs))
        lm_loss_sum(logits, labels).backward()
    return len(calls)


def test_host_reads_per_microbatch_do_not_grow_with_depth(tiny_spec):
    shallow, deep = _host_reads(tiny_spec, 2), _host_reads(tiny_spec, 6)
    assert shallow == deep <= 4
    # Negative control: attention arguments made per block read the host once per block.
    assert _host_reads(tiny_spec, 6, reset_each_block=True) > deep


def test_the_lm_loss_reads_nothing_back_and_is_the_labelled_positions_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX
    with host_reads() as calls:
        loss = lm_loss_sum(logits, labels, 0.5)
    assert calls == []
    valid = labels != IGNORE_INDEX
    ref = torch.nn.functional.cross_entropy(logits[valid], labels[valid], reduction="sum") * 0.5
    torch.testing.assert_close(loss, ref)
    assert (lm_loss_sum(logits, torch.randint(0, 11, (2, 7), generator=g), 0.5) - ref).abs() > 1e-3  # control
    none = lm_loss_sum(logits, torch.full_like(labels, IGNORE_INDEX))
    none.backward()
    assert float(none) == 0.0 and not logits.grad.any()


def test_the_setting_is_auto_true_or_false():
    from test_checkpoint_init import load_recipe_tiny

    assert load_recipe_tiny([]).train.compile == "auto"
    assert load_recipe_tiny(["train.compile=true"]).train.compile is True
    with pytest.raises(ConfigError, match=r"'train.compile' expects"):
        load_recipe_tiny(["train.compile=fast"])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_enabled("auto", cuda) and not compile_enabled("auto", cpu)
    assert compile_enabled(True, cpu) and not compile_enabled(False, cuda)


def test_a_block_compiles_its_decoder_layer_not_its_per_microbatch_preparation(tiny_spec):
    block = _llm(tiny_spec, 1).layers[1]
    assert compile_targets(block) == [block.layer]


def test_a_channels_last_unet_computes_what_the_default_layout_does():
    from disttrain_ds.models.channels_last import to_channels_last

    spec, model, mb, _ = _model_and_batch("tiny_cpu.yaml")
    _, ref, _, _ = _model_and_batch("tiny_cpu.yaml")
    ref.load_state_dict(model.state_dict())
    unet = model.generator
    assert spec.family("generator").channels_last and not spec.family("llm").channels_last
    to_channels_last(unet)
    shapes = []
    for layer in unet.layers[1:]:
        layer.register_forward_hook(lambda m, a, out: shapes.append(out[0] if isinstance(out, tuple) else out))
    out, expected = model(mb), ref(mb)
    out["loss"].backward()
    expected["loss"].backward()
    torch.testing.assert_close(out["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    for p, q in zip(unet.parameters(), ref.generator.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert list(unet.state_dict()) == list(ref.generator.state_dict())
    four_d = [t for t in shapes if t.dim() == 4]
    assert four_d and all(t.is_contiguous(memory_format=torch.channels_last) for t in four_d)
    # Control: the default layout's activations are not channels-last.
    plain = []
    ref.generator.layers[2].register_forward_hook(lambda m, a, out: plain.append(out[0]))
    ref(mb)
    assert not plain[0].is_contiguous(memory_format=torch.channels_last)


def _unet_layers(channels_last: bool = False) -> tuple[list[nn.Module], nn.Module]:
    """The tiny U-Net's pipeline layers (without the projector) and a copy of the whole model."""
    import copy

    from disttrain_ds.families.unet.config import GeneratorConfig
    from disttrain_ds.families.unet.model import (
        UnetDown,
        UnetIn,
        UnetMid,
        UnetOut,
        UnetUp,
        _in_parts,
        _out_parts,
        build_unet,
    )

    torch.manual_seed(0)
    u = build_unet(GeneratorConfig())
    if channels_last:
        u = u.to(memory_format=torch.channels_last)
    ref = copy.deepcopy(u)
    layers = [UnetIn(_in_parts(u)), *(UnetDown(b) for b in u.down_blocks), UnetMid(u.mid_block),
              *(UnetUp(b, i == len(u.up_blocks) - 1) for i, b in enumerate(u.up_blocks)), UnetOut(_out_parts(u))]
    return layers, ref


def _unet_step(layers, ref, n: int) -> None:
    """Images per microbatch ``n`` through the layers (forward and backward), checked against the
    whole diffusers model."""
    g = torch.Generator().manual_seed(n)
    x, t, c = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 1000, (n,), generator=g), \
        torch.randn(n, 4, 32, generator=g)
    h = (c, x, t)
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    torch.testing.assert_close(h, ref(x, t, encoder_hidden_states=c).sample, rtol=1e-5, atol=1e-5)


def test_unet_layers_compile_once_for_every_number_of_images():
    # Only the images-per-microbatch dimension is dynamic: the down blocks (one code object at two
    # resolutions) keep static spatial sizes, which inductor needs for their convolutions. The
    # first three layers (the slow test below runs the whole U-Net through inductor).
    import copy

    layers = _unet_layers()[0][:3]
    eager = copy.deepcopy(layers)
    counter = CompileCounter()
    compile_layers(layers, backend=counter)
    made = []
    for n in (1, 2, 3, 5, 8):
        h = (torch.randn(n, 4, 32), torch.randn(n, 3, 16, 16), torch.randint(0, 1000, (n,)))
        out, ref = h, h
        for layer, same in zip(layers, eager):
            out, ref = layer(out), same(ref)
        out[0].sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        made.append(counter.frame_count)
    # One image is its own (specialised) graph per layer, any other count one dynamic graph per layer.
    assert made == [3, 6, 6, 6, 6], made
    # Negative control: static layers compile again for every number of images.
    counter = CompileCounter()
    for layer in eager[:2]:
        layer.compile(dynamic=False, backend=counter)
    grew = []
    for n in (1, 2, 3, 5):
        h = (torch.randn(n, 4, 32), torch.randn(n, 3, 16, 16), torch.randint(0, 1000, (n,)))
        eager[1](eager[0](h))[0].sum().backward()
        grew.append(counter.frame_count)
    assert grew == [2, 4, 6, 8], grew


@pytest.mark.slow
def test_unet_layers_in_channels_last_lower_through_inductor_at_any_number_of_images():
    # Inductor builds C++ for every kernel on the CPU (minutes): the slow tier. The layout is the
    # one CUDA runs (models/channels_last.py), whose strides inductor must order.
    layers, ref = _unet_layers(channels_last=True)
    before = graphs_compiled()
    compile_layers(layers)
    for n in (1, 2, 3):
        _unet_step(layers, ref, n)
    assert graphs_compiled() - before == 2 * len(layers)
