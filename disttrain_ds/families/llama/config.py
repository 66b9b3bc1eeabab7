"""The decoder LLM's section (families ``llama`` and ``qwen2``) and the Llama presets; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class LLMConfig:
    """LLM backbone (family llama or qwen2: transformers decoder layers) with an LM head."""

    family: str = "llama"
    """Model family (llama | qwen2): which network this module is (``disttrain_ds/families``)."""
    preset: str = "tiny"
    """Named size (tiny | llama-7b | llama-13b | llama-70b | llama3.2-1b | llama3.2-3b); fields given
    beside it override it."""
    hidden_size: int = 64
    """Model width."""
    layers: int = 4
    """Number of decoder layers."""
    heads: int = 4
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention when below ``heads``)."""
    ffn_hidden: int = 128
    """SwiGLU inner width."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's size (base vocabulary plus special tokens)."""
    max_position: int = 8192
    """Largest position for rotary embeddings."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_type: Literal["default", "linear", "dynamic", "llama3", "yarn"] = "default"
    """RoPE variant as transformers names it (``rope_type``): plain, or a context-extension scaling
    whose parameters are ``rope_scaling`` (Llama 3.1+ checkpoints say llama3)."""
    rope_scaling: dict[str, int | float | bool] = field(default_factory=dict)
    """The scaling's parameters under transformers' names (``factor``, ``original_max_position_embeddings``,
    ``low_freq_factor``, ``high_freq_factor``, ``beta_fast``, ...); empty for the default RoPE."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (transformers' Llama default; Llama 2 and 3 checkpoints say 1e-5)."""
    head_dim: int = 0
    """Width of one attention head; 0: ``hidden_size / heads`` (a checkpoint's ``head_dim`` that
    differs is read into it: q and o projections are then ``heads * head_dim`` wide)."""
    attention_bias: bool = False
    """Biases on the q / k / v / o projections (Llama's ``attention_bias``; Qwen2's q / k / v biases
    are its family's own and need no field)."""
    mlp_bias: bool = False
    """Biases on the gate / up / down projections (Llama's ``mlp_bias``)."""
    tie_embeddings: bool = False
    """The LM head is the input embedding (transformers' ``tie_word_embeddings``: Llama 3.2 1B/3B,
    Qwen2.5 up to 3B, SmolLM2). One parameter where embedding and head share a pipeline stage;
    across stages each keeps a copy and their gradients are summed before every step. Under TP the
    embedding is then split by vocabulary rows like the head."""
    doc_attention: Literal["auto", "spans", "flex", "varlen"] = "auto"
    """How attention stays inside each packed document (``models/doc_mask.py``): ``spans`` runs
    causal SDPA per document span, ``flex`` compiled flex attention with a block mask (CUDA only:
    no backward on CPU), ``varlen`` flash attention over variable lengths from the documents'
    offsets (CUDA and ``train.dtype: bf16`` only), ``auto`` flex on CUDA for microbatches that pack
    several documents (or a document and padding) in a row, spans otherwise. All compute the same
    function."""
    frozen: bool = False
    """Keep the backbone's weights fixed (gradients still flow through to the encoders' projectors)."""
    checkpoint: str = ""
    """Local Llama weights (.safetensors file or save_pretrained directory); empty: seeded random init.
    A directory's ``config.json`` fixes the shapes and settings (fields left out of the recipe are
    read from it; one written differently is an error)."""


_LLAMA32 = dict(rope_theta=500000.0, rope_type="llama3", max_position=131072, rms_norm_eps=1e-5, tie_embeddings=True,
                rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
"""What Llama 3.2 checkpoints share beyond their sizes."""

LLM_PRESETS: dict[str, dict] = {
    "tiny": {},
    # The paper's backbone table (disttrain_ds/paper/disttrain_paper.json: llm_backbones); vocab per family.
    "llama-7b": dict(hidden_size=4096, layers=32, heads=32, kv_heads=32, ffn_hidden=11008, vocab_size=32000),
    "llama-13b": dict(hidden_size=5120, layers=40, heads=40, kv_heads=40, ffn_hidden=13824, vocab_size=32000),
    "llama-70b": dict(
        hidden_size=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, vocab_size=128256, rope_theta=500000.0
    ),
    # meta-llama/Llama-3.2-1B and -3B config.json: tied embeddings, Llama 3.1 RoPE scaling, eps 1e-5.
    "llama3.2-1b": dict(hidden_size=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        **_LLAMA32),
    "llama3.2-3b": dict(hidden_size=3072, layers=28, heads=24, kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        **_LLAMA32),
}
