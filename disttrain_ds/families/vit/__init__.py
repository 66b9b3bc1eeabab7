"""ViT image encoder (transformers ``ViTModel`` layers) with its MLP input projector."""

from disttrain_ds.families.base import Family
from disttrain_ds.families.vit.config import ENCODER_PRESETS, EncoderConfig
from disttrain_ds.families.vit.estimates import cost_terms, encoder_activations, item_flops, patches, rows
from disttrain_ds.families.vit.hf_settings import vit_fields

_HF = r"^(?:vit\.)?encoder\.layer\.(\d+)\."


def _problems(cfg: EncoderConfig, prefix: str) -> list[tuple[str, str]]:
    out = []
    if cfg.hidden_size % cfg.heads:
        out.append((f"{prefix}.heads", f"{cfg.heads} must divide hidden_size {cfg.hidden_size}"))
    return out


FAMILY = Family(
    sliced_tp=True,
    name="vit",
    role="encoder",
    modality="image",
    config_type=EncoderConfig,
    presets=ENCODER_PRESETS,
    model="disttrain_ds.families.vit.model",
    width=lambda cfg: cfg.hidden_size,
    width_key="hidden_size",
    layer_count=lambda cfg: cfg.layers + 2,  # embed, blocks, head (norm)
    tp_sizes=lambda cfg, prefix, llm_hidden: [
        (f"{prefix}.heads", cfg.heads), (f"{prefix}.ffn_hidden", cfg.ffn_hidden),
    ],
    problems=_problems,
    hf_rules=(
        # Hub / save_pretrained layout (encoder.layer.N.attention.attention.query ...).
        (_HF + r"attention\.attention\.query\.(.*)$", r"block\1/layer.attention.q_proj.\2"),
        (_HF + r"attention\.attention\.key\.(.*)$", r"block\1/layer.attention.k_proj.\2"),
        (_HF + r"attention\.attention\.value\.(.*)$", r"block\1/layer.attention.v_proj.\2"),
        (_HF + r"attention\.output\.dense\.(.*)$", r"block\1/layer.attention.o_proj.\2"),
        (_HF + r"intermediate\.dense\.(.*)$", r"block\1/layer.mlp.fc1.\2"),
        (_HF + r"output\.dense\.(.*)$", r"block\1/layer.mlp.fc2.\2"),
        (_HF + r"(layernorm_before|layernorm_after)\.(.*)$", r"block\1/layer.\2.\3"),
        # In-memory transformers 5 names.
        (r"^(?:vit\.)?embeddings\.(.*)$", r"embed/embeddings.\1"),
        (r"^(?:vit\.)?layers\.(\d+)\.(.*)$", r"block\1/layer.\2"),
        (r"^(?:vit\.)?layernorm\.(.*)$", r"head/layernorm.\1"),
    ),
    hf_formats="transformers ViTModel",
    checkpoint_fields=vit_fields,
    activation_layers=encoder_activations,
    cost_terms=cost_terms,
    item_size=patches,
    item_flops=item_flops,
    rows=rows,
    sp_heads=lambda cfg: (cfg.heads, cfg.heads),
)
