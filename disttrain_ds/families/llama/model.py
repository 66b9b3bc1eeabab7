"""LLM backbone as pipeline layers: embedding (+ image scatter), decoder blocks, norm + LM head.

Written for Llama; any decoder family of the same shape (RMSNorm, rotary positions, one decoder
layer class) reuses it by passing its own ``Decoder`` (see ``families/qwen2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from disttrain_ds.families.base import BuildContext
from disttrain_ds.families.llama import sharded
from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.models.doc_mask import DOC_ATTENTION, doc_attention_kwargs, doc_positions
from disttrain_ds.models.layers import LayerDef, SlicedLayer, seeded, tied_to


def hf_kwargs(cfg: LLMConfig) -> dict:
    """transformers config arguments shared by Llama-shaped decoders."""
    if cfg.vocab_size <= 0:
        raise ValueError("llm.vocab_size must be resolved (positive) before building the model")
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.heads,
        max_position_embeddings=cfg.max_position,
        rope_parameters={"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, **cfg.rope_scaling},
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )


def hf_config(cfg: LLMConfig) -> LlamaConfig:
    return LlamaConfig(**hf_kwargs(cfg), attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)


def hf_model(cfg: LLMConfig) -> LlamaForCausalLM:
    """The whole transformers model this family's layers correspond to (what export writes)."""
    return LlamaForCausalLM(hf_config(cfg))


@dataclass(frozen=True)
class Decoder:
    """The transformers classes one Llama-shaped decoder family is built from."""

    config: Callable[[LLMConfig], PretrainedConfig]
    """Our config -> the family's transformers config."""
    layer: type
    """Decoder layer class, constructed as ``layer(hf_config, index)``."""
    norm: type
    """Final RMSNorm class, constructed as ``norm(hidden_size, eps=...)``."""
    rotary: type
    """Rotary embedding class, constructed as ``rotary(hf_config)``."""


LLAMA = Decoder(hf_config, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding)


class LlmEmbed(nn.Module):
    """(input_ids [B, S], embeds_1 [P_1, H], ..., embeds_n [P_n, H], doc_ids [B, S]) -> (hidden [B, S, H], doc_ids).

    The placeholders of ``tokens[i]`` are replaced, in sequence order, by the rows of ``embeds_i``
    (the projected outputs of the i-th upstream encoder: image patches, audio frames). ``doc_ids``
    (each position's document, ``models/doc_mask.py``) travels with the hidden states to every
    block, across pipeline stages too.

    Under sequence parallelism (``seq_parallel``, set by ``parallel/sequence_parallel.py::attach``)
    every rank of the SP group embeds whole rows and keeps its slice of the hidden states; ``doc_ids``
    stay whole, since attention sees whole rows. Under sequence-sharded tensor parallelism
    (``tp_seq``, ``parallel/tp_sequence.py::attach``) likewise within the TP group."""

    def __init__(self, cfg: LLMConfig, image_token: int, tokens: tuple[int, ...] = ()):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.vocab_parallel = cfg.tie_embeddings  # under TP: rows split like the head it is tied to
        self.image_token = image_token
        self.tokens = tuple(tokens) or (image_token,)

    def compile_targets(self) -> list[nn.Module]:
        return []  # a lookup and a scatter; the placeholder check reads a count on the host

    def forward(self, inputs):
        input_ids, *embeds, doc_ids = inputs
        if len(embeds) != len(self.tokens):
            raise ValueError(f"{len(embeds)} encoder outputs for {len(self.tokens)} placeholder kinds")
        if doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids {tuple(doc_ids.shape)} do not match input_ids {tuple(input_ids.shape)}")
        hidden = self.embed_tokens(input_ids)
        for token, rows in zip(self.tokens, embeds):
            mask = input_ids == token
            kind = "image" if token == self.image_token else f"token {token}"
            if input_ids.device.type == "cpu":  # the count is at hand: say what is wrong
                if (n := int(mask.sum())) != rows.shape[0]:
                    raise ValueError(f"{n} {kind} placeholders but {rows.shape[0]} encoder rows for them")
            else:  # checked on the device, so the step does not wait here to read the count
                torch._assert_async(mask.sum() == rows.shape[0], f"{kind} placeholders and encoder rows differ in number")
            hidden = hidden.masked_scatter(mask.unsqueeze(-1), rows.to(hidden.dtype))
        if self.seq_parallel is not None:
            hidden = self.seq_parallel.shard(hidden).contiguous()
        if self.tp_seq is not None:
            hidden = self.tp_seq.scatter(hidden)
        return hidden, doc_ids


_ROTARY: tuple = ()
"""(doc_ids, its version, the rotary table's key, the SP group, (positions, rotary table)) of the
last microbatch a block saw."""


class LlmBlock(nn.Module):
    """(hidden, doc_ids) -> (hidden, doc_ids): one decoder layer, causal inside each document
    (per span or through flex attention, ``cfg.doc_attention``), rotary positions restarting at
    each document. Under sequence parallelism ``hidden`` is this rank's slice of every row and
    ``doc_ids`` the whole rows: positions are the slice's own, attention exchanges heads for rows.

    Positions, the rotary table and the attention arguments are made once per microbatch by the
    stage's first block and reused by the others (``_ROTARY``, ``doc_attention_kwargs``); only
    the decoder layer itself is compiled (``compile_targets``), so they stay outside its graph.

    Under sequence-sharded tensor parallelism (``tp_seq``) ``hidden`` is this rank's slice of every
    row within the TP group and the layer runs through ``sharded.decoder`` (its linears gather and
    reduce-scatter, overlapped with their GEMMs); positions and attention are of whole rows."""

    tp_seq_region = True  # computes on slices: replicated weights' gradients summed over TP

    def __init__(self, cfg: LLMConfig, index: int, decoder: Decoder = LLAMA):
        super().__init__()
        self.seq_parallel = None
        self.tp_seq = None
        hf = decoder.config(cfg)
        hf._attn_implementation = DOC_ATTENTION  # this block's own config: attention per document
        self.doc_attention = cfg.doc_attention
        self.layer = decoder.layer(hf, index)
        object.__setattr__(self, "sliced", SlicedLayer(self.layer, sharded.decoder))  # unregistered: no new names
        self.rotary = decoder.rotary(hf)
        # Blocks of one config make the same table: a key of what it is made from.
        self._rotary_key = (type(self.rotary), repr(getattr(hf, "rope_parameters", None)), getattr(hf, "head_dim", None),
                            getattr(hf, "partial_rotary_factor", 1.0), hf.hidden_size, hf.num_attention_heads,
                            hf.max_position_embeddings)

    def compile_targets(self) -> list[nn.Module]:
        # On slices the collectives run between the layer's modules: the sliced forward is compiled
        # around them (they stay eager, ``TPSeqContext``).
        return [self.sliced if self.tp_seq is not None else self.layer]

    def _positions(self, hidden, doc_ids):
        """(position ids, rotary (cos, sin)) of this microbatch, made once for every block."""
        global _ROTARY
        key = (self._rotary_key, hidden.dtype, hidden.device)
        if (_ROTARY and _ROTARY[0] is doc_ids and _ROTARY[1] == doc_ids._version and _ROTARY[2] == key
                and _ROTARY[3] is self.seq_parallel):
            return _ROTARY[4]
        pos = doc_positions(doc_ids)
        if self.seq_parallel is not None:
            pos = self.seq_parallel.shard(pos)
        made = (pos, self.rotary(hidden, pos))
        _ROTARY = (doc_ids, doc_ids._version, key, self.seq_parallel, made)
        return made

    def forward(self, inputs):
        hidden, doc_ids = inputs
        pos, table = self._positions(hidden, doc_ids)
        attention = doc_attention_kwargs(doc_ids, self.doc_attention)
        if self.seq_parallel is not None:
            attention = {**attention, "seq_parallel": self.seq_parallel}
        if self.tp_seq is not None:
            return self.sliced(hidden, self.tp_seq, table, **attention), doc_ids
        # No [S, S] mask: spans or a block mask, built once per microbatch (bench/bench_doc_mask.py).
        out = self.layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=table, **attention)
        return (out[0] if isinstance(out, tuple) else out), doc_ids


class LlmHead(nn.Module):
    """(hidden, doc_ids) -> (logits [B, S, V], normed hidden [B, S, H]); the latter feeds the generator.
    Under sequence-sharded tensor parallelism (``tp_seq``) it first joins the slices into whole rows."""

    def __init__(self, cfg: LLMConfig, decoder: Decoder = LLAMA):
        super().__init__()
        self.tp_seq = None
        self.norm = decoder.norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, inputs):
        hidden, _ = inputs
        if self.tp_seq is not None:
            hidden = self.tp_seq.gather(hidden)
        h = self.norm(hidden)
        return self.lm_head(h), h


def decoder_layers(cfg: LLMConfig, ctx: BuildContext, decoder: Decoder) -> list[LayerDef]:
    """Ordered pipeline layers of a decoder LLM: embed, ``cfg.layers`` decoder blocks, head."""
    seed, module = ctx.seed, ctx.module
    embed = seeded(seed, module, "embed", lambda: LlmEmbed(cfg, ctx.image_token, ctx.placeholders))
    head = seeded(seed, module, "head", lambda: LlmHead(cfg, decoder))
    if cfg.tie_embeddings:
        head = tied_to(head, "lm_head.weight", embed, "embed_tokens.weight")
    blocks = [seeded(seed, module, f"block{i}", lambda i=i: LlmBlock(cfg, i, decoder)) for i in range(cfg.layers)]
    return [embed, *blocks, head]


def llm_layers(cfg: LLMConfig, ctx: BuildContext) -> list[LayerDef]:
    return decoder_layers(cfg, ctx, LLAMA)


layers = llm_layers

def embed_plan(embed: LlmEmbed) -> dict[str, str]:
    """A tied embedding splits its vocabulary rows as the head does; an untied one stays replicated."""
    return {"embed_tokens": "vocab"} if embed.vocab_parallel else {}


TP_PLAN = (
    (LlamaAttention, {"q_proj": "col", "k_proj": "col", "v_proj": "col", "o_proj": "row"}),
    (LlamaMLP, {"gate_proj": "col", "up_proj": "col", "down_proj": "row"}),
    (LlmHead, {"lm_head": "col_gather"}),
    (LlmEmbed, embed_plan),
)
