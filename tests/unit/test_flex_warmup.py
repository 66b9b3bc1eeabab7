"""Flex attention compiled before step 1 (``mllm/flex_warmup.py``): nothing happens off CUDA, the
shapes come from the stage's own LLM blocks, and the dummy call is the blocks' own call (same
layout, scale, mask and grad modes), checked here with the compiled kernel replaced."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tp_seq_vit_cases import MIXED, encoder_defs  # tests/ is on sys.path under pytest

from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.families.llama.model import LlmBlock
from disttrain_ds.mllm import flex_warmup
from disttrain_ds.mllm.flex_warmup import FlexShape, exercise, exercise_items, flex_shapes, warm_up_items, warm_up_stage
from disttrain_ds.models import doc_mask, item_attention, packed_tp
from disttrain_ds.models.pixels import pack_images
from disttrain_ds.samples import doc_ids

CFG = LLMConfig(hidden_size=64, heads=4, kv_heads=2, ffn_hidden=128, layers=2, vocab_size=32, doc_attention="flex")


class Recorder:
    """Stands in for the compiled ``flex_attention``: records what each call got."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, block_mask=None, scale=None, enable_gqa=False):
        self.calls.append({"qkv": [(tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in (q, k, v)],
                           "grad_mode": torch.is_grad_enabled(), "scale": scale, "enable_gqa": enable_gqa,
                           "seq_lengths": block_mask.seq_lengths, "block": block_mask.BLOCK_SIZE,
                           "kv_blocks": tuple(block_mask.kv_num_blocks.shape)})
        return q * 1.0 + 0.0 * (k.sum() + v.sum())  # differentiable in all three, like the kernel


@pytest.fixture
def kernel(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(doc_mask, "_FLEX", {False: rec, True: rec})
    return rec


def test_warm_up_is_a_no_op_off_cuda(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("flex compiled on CPU")

    monkeypatch.setattr(doc_mask, "_FLEX", {False: never, True: never})
    monkeypatch.setattr(flex_warmup, "exercise", never)
    stage = torch.nn.Sequential(LlmBlock(CFG, 0), LlmBlock(CFG, 1))
    assert warm_up_stage(stage, batch=2, seq_len=256, device=torch.device("cpu")) == 0


def test_shapes_come_from_the_blocks_that_take_the_flex_path_per_tp_rank():
    stage = torch.nn.Sequential(LlmBlock(CFG, 0), LlmBlock(CFG, 1),
                                LlmBlock(dataclasses.replace(CFG, doc_attention="spans"), 2))
    want = FlexShape(batch=3, seq_len=256, heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, scale=0.25)
    assert flex_shapes(stage, batch=3, seq_len=256, tp=2) == [want]  # two alike blocks: one shape
    stage.to(torch.bfloat16)
    assert flex_shapes(stage, batch=3, seq_len=256, tp=2)[0].dtype == torch.bfloat16
    auto = torch.nn.Sequential(LlmBlock(dataclasses.replace(CFG, doc_attention="auto"), 0))
    assert len(flex_shapes(auto, batch=1, seq_len=256)) == 1  # auto takes flex on CUDA
    assert flex_shapes(auto, batch=1, seq_len=256, device_type="cpu") == []  # and spans elsewhere
    assert flex_shapes(torch.nn.Linear(2, 2), batch=1, seq_len=256) == []  # no LLM block: nothing to compile


def test_warm_up_on_cuda_exercises_each_shape_once(monkeypatch):
    seen = []
    monkeypatch.setattr(flex_warmup, "exercise", lambda shape, device, backward: seen.append((shape, device, backward)))
    stage = torch.nn.Sequential(LlmBlock(CFG, 0), LlmBlock(CFG, 1))
    assert warm_up_stage(stage, batch=2, seq_len=256, device=torch.device("cuda"), backward=False) == 1
    assert seen == [(flex_shapes(stage, batch=2, seq_len=256)[0], torch.device("cuda"), False)]


def _block_call(kernel: Recorder, monkeypatch, seq_len: int) -> dict:
    """What one LLM block hands the kernel on a multi-document batch of two rows."""
    block = LlmBlock(CFG, 0)
    docs = torch.stack([doc_ids((100, 50), seq_len), doc_ids((30, seq_len - 30), seq_len)])
    hidden = torch.randn(2, seq_len, CFG.hidden_size, requires_grad=True)
    with monkeypatch.context() as m:  # on CPU the block takes the span path; make it take flex, as on CUDA
        m.setattr(doc_mask, "doc_attention_path", lambda choice, device: "flex")
        block((hidden, docs))
    return kernel.calls.pop()


def test_the_dummy_call_is_the_blocks_call_in_both_grad_modes(kernel, monkeypatch):
    real = _block_call(kernel, monkeypatch, 200)
    shape = flex_shapes(torch.nn.Sequential(LlmBlock(CFG, 0)), batch=2, seq_len=200)[0]
    exercise(shape, torch.device("cpu"))
    with_grad, no_grad = kernel.calls
    assert with_grad == real  # shapes, strides, dtype, requires_grad, scale, GQA, block mask
    assert with_grad["scale"] == 16 ** -0.5 and with_grad["enable_gqa"] and with_grad["seq_lengths"] == (200, 200)
    assert with_grad["block"] == (doc_mask.FLEX_BLOCK, doc_mask.FLEX_BLOCK)
    assert with_grad["kv_blocks"] == (2, 1, 2)  # [B, 1, query blocks]
    assert not no_grad["grad_mode"] and not any(r for *_, r in no_grad["qkv"])  # checkpointing's first pass
    assert {k: v for k, v in no_grad.items() if k not in ("grad_mode", "qkv")} == \
        {k: v for k, v in real.items() if k not in ("grad_mode", "qkv")}


def test_a_stage_without_backward_warms_the_forward_without_gradients(kernel):
    shape = FlexShape(1, 128, 4, 4, 8, torch.float32, 0.5)
    exercise(shape, torch.device("cpu"), backward=False)
    first, second = kernel.calls
    assert first["grad_mode"] and not any(r for *_, r in first["qkv"]) and not first["enable_gqa"]
    assert not second["grad_mode"]


def _vit_block() -> torch.nn.Module:
    return encoder_defs("vit")[1].build()  # the two-block test ViT's first block


def _signature(call: dict) -> dict:
    """A kernel call without its row count: layout (strides past the first), dtype, grad, scale."""
    return {"qkv": [(shape[1], shape[3], stride[1:], dtype, grad) for shape, stride, dtype, grad in call["qkv"]],
            "grad_mode": call["grad_mode"], "scale": call["scale"], "enable_gqa": call["enable_gqa"],
            "block": call["block"]}


def test_the_item_warm_up_makes_the_encoder_blocks_own_flex_calls(kernel, monkeypatch):
    block = _vit_block()
    monkeypatch.setattr(item_attention, "items_path", lambda sizes, dropout, device, dtype: "flex")  # as on CUDA
    monkeypatch.setattr(packed_tp, "varlen_items", lambda hidden, sizes: True)
    flat, hw = pack_images([torch.randn(3, s, s) for s in MIXED])
    hidden, counts = encoder_defs("vit")[0].build()((flat, hw))
    block((hidden, counts))
    real = kernel.calls.pop()
    exercise_items(block, torch.device("cpu"))
    calls = kernel.calls
    assert [c["seq_lengths"] for c in calls] == [(100, 100)] * 2 + [(257, 257)] * 2  # WARM_ITEMS, both grad modes
    assert _signature(calls[0]) == _signature(real) and real["qkv"][0][3]  # heads, layout, dtype, scale, grad
    assert _signature(calls[0])["qkv"][0][:2] == (4, 8) and calls[0]["scale"] == 8 ** -0.5
    assert not calls[1]["grad_mode"] and calls[2]["grad_mode"] and not calls[3]["grad_mode"]


def test_the_item_warm_up_runs_every_encoder_block_on_cuda_and_nothing_elsewhere(monkeypatch):
    seen = []
    monkeypatch.setattr(flex_warmup, "exercise_items", lambda block, device, backward: seen.append(backward))
    stage = torch.nn.Sequential(*[d.build() for d in encoder_defs("vit")], LlmBlock(CFG, 0))
    assert warm_up_items(stage, torch.device("cpu")) == 0 and seen == []
    assert warm_up_items(stage, torch.device("cuda"), backward=False) == 2 and seen == [False, False]
