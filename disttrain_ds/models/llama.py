"""LLM backbone as pipeline layers: embedding (+ image scatter), Llama decoder blocks, norm + LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ..data.types import IGNORE_INDEX
from .configs import LLMConfig
from .layers import LayerDef, seeded


def hf_config(cfg: LLMConfig) -> LlamaConfig:
    if cfg.vocab_size <= 0:
        raise ValueError("llm.vocab_size must be resolved (positive) before building the model")
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_position,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )


class LlmEmbed(nn.Module):
    """(input_ids [B, S], image_embeds [P, H]) -> (hidden [B, S, H],).

    Image placeholders are replaced, in order, by the projected patch embeddings from the encoder.
    """

    def __init__(self, cfg: LLMConfig, image_token: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.image_token = image_token

    def forward(self, inputs):
        input_ids, image_embeds = inputs
        hidden = self.embed_tokens(input_ids)
        mask = input_ids == self.image_token
        n = int(mask.sum())
        if n != image_embeds.shape[0]:
            raise ValueError(f"{n} image placeholders but {image_embeds.shape[0]} image embeddings")
        if n:
            hidden = hidden.masked_scatter(mask.unsqueeze(-1), image_embeds.to(hidden.dtype))
        return (hidden,)


class LlmBlock(nn.Module):
    """(hidden,) -> (hidden,): one Llama decoder layer (causal, rotary positions)."""

    def __init__(self, cfg: LLMConfig, index: int):
        super().__init__()
        hf = hf_config(cfg)
        self.layer = LlamaDecoderLayer(hf, index)
        self.rotary = LlamaRotaryEmbedding(hf)

    def forward(self, inputs):
        (hidden,) = inputs if isinstance(inputs, tuple) else (inputs,)
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # attention_mask=None with SDPA gives causal attention over the packed sequence.
        out = self.layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=self.rotary(hidden, pos))
        return (out[0] if isinstance(out, tuple) else out,)


class LlmHead(nn.Module):
    """(hidden,) -> (logits [B, S, V], normed hidden [B, S, H]); the latter feeds the generator."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.norm = LlamaRMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, inputs):
        (hidden,) = inputs if isinstance(inputs, tuple) else (inputs,)
        h = self.norm(hidden)
        return self.lm_head(h), h


def llm_layers(cfg: LLMConfig, image_token: int, seed: int) -> list[LayerDef]:
    """Ordered pipeline layers of the LLM: embed, ``cfg.layers`` decoder blocks, head."""
    defs = [seeded(seed, "llm", "embed", lambda: LlmEmbed(cfg, image_token))]
    for i in range(cfg.layers):
        defs.append(seeded(seed, "llm", f"block{i}", lambda i=i: LlmBlock(cfg, i)))
    defs.append(seeded(seed, "llm", "head", lambda: LlmHead(cfg)))
    return defs


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled positions (label[i] is predicted at i)."""
    valid = labels != IGNORE_INDEX
    if not bool(valid.any()):
        return logits.sum() * 0.0
    return F.cross_entropy(logits[valid].float(), labels[valid])


def gen_condition(hidden: torch.Tensor, gen_mask: torch.Tensor, query_tokens: int) -> torch.Tensor:
    """Hidden states at the generation-query positions, as [n_images, query_tokens, H]."""
    picked = hidden[gen_mask]
    if picked.shape[0] % query_tokens:
        raise ValueError(f"{picked.shape[0]} generation queries is not a multiple of {query_tokens}")
    return picked.view(-1, query_tokens, hidden.shape[-1])
