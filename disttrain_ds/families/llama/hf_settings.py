"""What a Llama-shaped decoder's ``config.json`` says, as this family's section fields.

Every setting that changes the math is either carried into the section (shapes, RoPE base and
scaling, RMSNorm eps) or refused in one line naming it: a checkpoint is never trained as another model.
No torch import: the recipe loader reads this.
"""

from __future__ import annotations

from typing import Any

from disttrain_ds.errors import ConfigError
from disttrain_ds.families.hf_config_checks import require_kind, require_positive_ints

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
"""config.json keys a decoder checkpoint must have."""

ROPE_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "llama3": (frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
               frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
}
"""RoPE types the decoder families reproduce (transformers computes them): required and optional
parameters of each (``rope_theta`` aside)."""


def rope_problem(kind: str, params: dict[str, Any]) -> str | None:
    """Why ``(kind, params)`` is not a RoPE this family reproduces, or None."""
    if kind not in ROPE_KEYS:
        return f"rope_type {kind} is not reproduced (one of {' | '.join(ROPE_KEYS)})"
    required, optional = ROPE_KEYS[kind]
    if required - set(params):
        return f"rope_type {kind} needs {', '.join(sorted(required - set(params)))}"
    if set(params) - required - optional:
        return f"rope_type {kind} does not take {', '.join(sorted(set(params) - required - optional))}"
    return None


def _rope(hf: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """(rope type, rope base, scaling parameters) in either layout transformers writes
    (``rope_parameters`` since 5.0, ``rope_scaling`` + ``rope_theta`` before)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    return str(kind), float(theta), params


def decoder_fields(hf: dict[str, Any], where: str, model_types: tuple[str, ...], biases: bool = True) -> dict[str, Any]:
    """Section fields of a decoder LLM from its checkpoint's ``config.json`` (``where`` names the
    file in errors); a one-line ConfigError for a setting this family cannot reproduce. ``biases``:
    the family takes Llama's ``attention_bias`` / ``mlp_bias`` (Qwen2's biases are its classes' own)."""

    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"{where}: '{key}' {why}")

    require_kind(hf, "model_type", model_types, where)
    require_positive_ints(hf, REQUIRED, where)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kind, theta, scaling = _rope(hf)
    bad = rope_problem(kind, scaling)
    if bad:
        refuse("rope_scaling", bad)
    head_dim = hf.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        refuse("head_dim", f"must be a positive integer, got {head_dim!r}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False) and not biases:
            refuse(key, "is true: this family's projections carry the biases of its own classes only")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {hf['hidden_act']!r}; the decoder's MLP is SwiGLU (silu)")
    if hf.get("attention_dropout", 0.0):
        refuse("attention_dropout", f"is {hf['attention_dropout']}; training here runs without dropout")
    if hf.get("use_sliding_window", False):
        refuse("use_sliding_window", "is true: sliding-window attention is not reproduced yet")
    return {
        "hidden_size": hidden,
        "layers": hf["num_hidden_layers"],
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": 0 if head_dim == hidden // heads else head_dim,
        "attention_bias": bool(hf.get("attention_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "ffn_hidden": hf["intermediate_size"],
        "max_position": hf.get("max_position_embeddings", 8192),
        "rope_theta": theta,
        "rope_type": kind,
        "rope_scaling": scaling,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        # what transformers reads from a config.json that does not say (Llama / Qwen2 configs: false)
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
