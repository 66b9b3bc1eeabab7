"""Qwen2 layers: the Llama family's decoder layers built from transformers' Qwen2 classes."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2MLP,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.families.llama.model import Decoder, LlmEmbed, LlmHead, decoder_layers, embed_plan, hf_kwargs
from disttrain_ds.models.layers import LayerDef


def hf_config(cfg: LLMConfig) -> Qwen2Config:
    return Qwen2Config(**hf_kwargs(cfg))


def hf_model(cfg: LLMConfig) -> Qwen2ForCausalLM:
    """The whole transformers model this family's layers correspond to (what export writes)."""
    return Qwen2ForCausalLM(hf_config(cfg))


QWEN2 = Decoder(hf_config, Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding)


def layers(cfg: LLMConfig, ctx: BuildContext) -> list[LayerDef]:
    return decoder_layers(cfg, ctx, QWEN2)


TP_PLAN = (
    # Column-parallel q/k/v shard their biases with their output rows.
    (Qwen2Attention, {"q_proj": "col", "k_proj": "col", "v_proj": "col", "o_proj": "row"}),
    (Qwen2MLP, {"gate_proj": "col", "up_proj": "col", "down_proj": "row"}),
    (LlmHead, {"lm_head": "col_gather"}),
    (LlmEmbed, embed_plan),
)
