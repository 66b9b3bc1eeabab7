"""Qwen2 decoder LLM (transformers ``Qwen2DecoderLayer``: Llama's shape with biased q/k/v projections).

Everything but the transformers classes and the presets is the Llama family's code.
"""

from disttrain_ds.families.base import Family
from disttrain_ds.families.llama import (
    DECODER_HF_RULES,
    DECODER_VOCAB_PARAMS,
    decoder_activation_layers,
    decoder_problems,
    decoder_tp_sizes,
)
from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.families.llama.hf_settings import decoder_fields


def qwen2_problems(cfg: LLMConfig, prefix: str) -> list[tuple[str, str]]:
    """The decoder's size rules; Llama's optional biases are not Qwen2's (its q / k / v biases are fixed)."""
    out = decoder_problems(cfg, prefix)
    out += [(f"{prefix}.{k}", "is a llama-family setting (Qwen2 has biased q / k / v projections, nothing else)")
            for k in ("attention_bias", "mlp_bias") if getattr(cfg, k)]
    return out


PRESETS: dict[str, dict] = {
    "tiny": {},
    # Qwen/Qwen2-7B config.json (untied embeddings, grouped-query attention with 4 KV heads).
    "qwen2-7b": dict(hidden_size=3584, layers=28, heads=28, kv_heads=4, ffn_hidden=18944, vocab_size=152064,
                     rope_theta=1000000.0, max_position=32768),
}

FAMILY = Family(
    sliced_tp=True,
    name="qwen2",
    role="llm",
    config_type=LLMConfig,
    presets=PRESETS,
    model="disttrain_ds.families.qwen2.model",
    width=lambda cfg: cfg.hidden_size,
    width_key="hidden_size",
    layer_count=lambda cfg: cfg.layers + 2,  # embed, blocks, head
    tp_sizes=decoder_tp_sizes,
    problems=qwen2_problems,
    hf_rules=DECODER_HF_RULES,
    vocab_params=DECODER_VOCAB_PARAMS,
    activation_layers=decoder_activation_layers,  # Qwen2's q/k/v biases are parameters only
    hf_formats="transformers Qwen2ForCausalLM or Qwen2Model",
    checkpoint_fields=lambda hf, where: decoder_fields(hf, where, ("qwen2",), biases=False),
    sp_heads=lambda cfg: (cfg.heads, cfg.kv_heads),
    signed=("vocab_size", "head_dim"),  # 0: the tokenizer's size
)
