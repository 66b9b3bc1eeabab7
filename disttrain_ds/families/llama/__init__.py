"""Llama decoder LLM (transformers ``LlamaDecoderLayer``) with embedding, image scatter and LM head."""

from disttrain_ds.cost.activations import LayerBytes, SampleShape
from disttrain_ds.families.base import Family
from disttrain_ds.families.llama.config import LLM_PRESETS, LLMConfig
from disttrain_ds.families.llama.estimates import decoder_activations
from disttrain_ds.families.llama.hf_settings import decoder_fields, rope_problem


def decoder_tp_sizes(cfg: LLMConfig, prefix: str, llm_hidden: int) -> list[tuple[str, int]]:
    """Sizes a TP degree must divide in a Llama-shaped decoder."""
    return [(f"{prefix}.heads", cfg.heads), (f"{prefix}.kv_heads", cfg.kv_heads),
            (f"{prefix}.ffn_hidden", cfg.ffn_hidden)]


def decoder_activation_layers(cfg: LLMConfig, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Activation bytes of a Llama-shaped decoder (``estimates.py::decoder_activations``)."""
    return decoder_activations(cfg, shape, b)


DECODER_HF_RULES = (
    (r"^(?:model\.)?embed_tokens\.(.*)$", r"embed/embed_tokens.\1"),
    (r"^(?:model\.)?layers\.(\d+)\.(.*)$", r"block\1/layer.\2"),
    (r"^(?:model\.)?norm\.(.*)$", r"head/norm.\1"),
    (r"^lm_head\.(.*)$", r"head/lm_head.\1"),
)
"""Hugging Face causal-LM keys (``model.layers.N...``, ``lm_head``) onto embed / blockN / head."""

DECODER_VOCAB_PARAMS = ("embed/embed_tokens.weight", "head/lm_head.weight")
"""The decoder's tensors with one row per vocabulary id."""


def decoder_problems(cfg: LLMConfig, prefix: str) -> list[tuple[str, str]]:
    """Size rules of a Llama-shaped decoder."""
    out = []
    if cfg.hidden_size % cfg.heads and not cfg.head_dim:
        out.append((f"{prefix}.heads", f"{cfg.heads} must divide hidden_size {cfg.hidden_size} (or give head_dim)"))
    if cfg.head_dim < 0:
        out.append((f"{prefix}.head_dim", f"must be >= 0 (0: hidden_size / heads), got {cfg.head_dim}"))
    if cfg.heads % cfg.kv_heads:
        out.append((f"{prefix}.kv_heads", f"{cfg.kv_heads} must divide heads {cfg.heads}"))
    if cfg.vocab_size < 0:
        out.append((f"{prefix}.vocab_size", f"must be >= 0 (0: the tokenizer's size), got {cfg.vocab_size}"))
    if cfg.rope_theta <= 0:
        out.append((f"{prefix}.rope_theta", f"must be > 0, got {cfg.rope_theta}"))
    bad = rope_problem(cfg.rope_type, cfg.rope_scaling)
    if bad:
        out.append((f"{prefix}.rope_scaling", bad))
    if not cfg.rms_norm_eps > 0:
        out.append((f"{prefix}.rms_norm_eps", f"must be > 0, got {cfg.rms_norm_eps}"))
    return out


FAMILY = Family(
    sliced_tp=True,
    name="llama",
    role="llm",
    config_type=LLMConfig,
    presets=LLM_PRESETS,
    model="disttrain_ds.families.llama.model",
    width=lambda cfg: cfg.hidden_size,
    width_key="hidden_size",
    layer_count=lambda cfg: cfg.layers + 2,  # embed, blocks, head
    tp_sizes=decoder_tp_sizes,
    problems=decoder_problems,
    hf_rules=DECODER_HF_RULES,
    vocab_params=DECODER_VOCAB_PARAMS,
    activation_layers=decoder_activation_layers,
    hf_formats="transformers LlamaForCausalLM or LlamaModel",
    checkpoint_fields=lambda hf, where: decoder_fields(hf, where, ("llama",)),
    sp_heads=lambda cfg: (cfg.heads, cfg.kv_heads),
    signed=("vocab_size", "head_dim"),  # 0: the tokenizer's size, hidden_size / heads
)
