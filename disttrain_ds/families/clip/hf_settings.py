"""What a CLIP / SigLIP vision tower's ``config.json`` says, as the section fields of its family;
a setting the family does not reproduce is refused in one line naming it. No torch import."""

from __future__ import annotations

from typing import Any

from disttrain_ds.errors import ConfigError
from disttrain_ds.families.clip.config import ACTIVATIONS
from disttrain_ds.families.hf_config_checks import refuse_other_settings, require_kind, require_positive_ints

FIELDS = {"hidden_size": "hidden_size", "num_hidden_layers": "layers", "num_attention_heads": "heads",
          "intermediate_size": "ffn_hidden", "patch_size": "patch_size", "image_size": "image_size"}
"""config.json key -> section field (sizes)."""

FIXED = {"num_channels": 3, "attention_dropout": 0.0}
"""Settings the towers are built with: a checkpoint that says otherwise is refused."""

def tower_fields(hf: dict[str, Any], where: str, vision: str, whole: str, eps: float, act: str) -> dict[str, Any]:
    """Section fields of a vision tower from its checkpoint's ``config.json`` (``where`` names it):
    a vision model's (``model_type`` ``vision``) or a whole two-tower model's (``whole``: its
    ``vision_config`` is read). ``eps`` / ``act``: the library's defaults when the file does not say."""
    require_kind(hf, "model_type", (vision, whole), where)
    if hf["model_type"] == whole:
        hf = hf.get("vision_config")
        if not isinstance(hf, dict):
            raise ConfigError(f"{where}: 'vision_config' must be a mapping in a {whole} checkpoint")
    require_positive_ints(hf, FIELDS, where)
    refuse_other_settings(hf, FIXED, where, vision)
    out = {field: hf[key] for key, field in FIELDS.items()}
    out["layer_norm_eps"] = float(hf.get("layer_norm_eps", eps))
    out["hidden_act"] = hf.get("hidden_act", act)
    if out["hidden_act"] not in ACTIVATIONS:
        raise ConfigError(f"{where}: 'hidden_act' is {out['hidden_act']!r}; the tower is built with one of "
                          f"{' | '.join(ACTIVATIONS)}")
    if "feature_layer" in hf:  # written by disttrain-export: the file holds exactly the layers run
        out["feature_layer"] = hf["feature_layer"]
    return out


def clip_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    return tower_fields(hf, where, "clip_vision_model", "clip", 1e-5, "quick_gelu")
