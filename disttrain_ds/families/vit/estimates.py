"""ViT-family formulas: activation bytes (patch embedding, blocks, head, input projector, per
sample) and forward FLOPs per image; CLIP / SigLIP towers reuse them over the layers they run."""

from __future__ import annotations

from disttrain_ds.cost.activations import FP32, LayerBytes, SampleShape
from disttrain_ds.cost.dims import TransformerDims, image_flops, image_terms


def _dims(cfg, layers: int | None) -> TransformerDims:
    return TransformerDims(cfg.layers if layers is None else layers, cfg.hidden_size, cfg.ffn_hidden, cfg.heads)


def cost_terms(cfg, layers: int | None = None, cls_token: bool = True) -> dict[str, float]:
    """``CostModel`` encoder coefficients of one image (``layers``: the blocks one forward runs)."""
    return image_terms(_dims(cfg, layers), cfg.patch_size, cls_token)


def item_flops(cfg, patches: int, layers: int | None = None, cls_token: bool = True) -> float:
    """Forward FLOPs of one image of ``patches`` patches in the encoder's own layers."""
    return image_flops(_dims(cfg, layers), cfg.patch_size, cls_token, patches)


def patches(cfg, image) -> int:
    """Patches of one input image ``[3, H, W]`` (H and W multiples of the patch size)."""
    return (int(image.shape[1]) // cfg.patch_size) * (int(image.shape[2]) // cfg.patch_size)


def rows(cfg, n: int) -> int:
    """Output rows of an image of ``n`` patches: one per patch (a CLS token is dropped)."""
    return n


def encoder_activations(cfg, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Encoder: patch embedding, ViT blocks, head (norm, CLS dropped), input projector; per sample."""
    e, fe, a, p = cfg.hidden_size, cfg.ffn_hidden, cfg.heads, cfg.patch_size
    tokens = shape.patches + shape.images  # one CLS token per image
    pixels = 3 * p * p * shape.patches * b  # the patches the convolution reads
    # Per token: two LayerNorm inputs, normed inputs of q/k/v and the MLP, q, k, v, attention
    # output, GELU input and fc2 input.
    block = ((8 * e + 2 * fe) * b + (a + 4) * FP32) * tokens
    split = ((4 * e + 2 * fe) * b + a * FP32) * tokens  # q, k, v, attention output, MLP hidden
    # On slices of the packed rows (``families/vit/sharded.py``) each rank keeps both LayerNorms'
    # inputs and statistics for its slice only; the gathered whole rows the GEMMs read stay whole
    # (measured in tests/unit/test_memory_sliced.py).
    sliced = (2 * e * b + 4 * FP32) * tokens
    head = (e * b + 2 * FP32) * tokens
    projector = (e + 2 * llm_hidden) * b * shape.patches  # fc1 input, GELU input, fc2 input
    saved = [pixels, *[block] * cfg.layers, head, projector]
    outputs = [e * b * tokens] * (cfg.layers + 1) + [e * b * shape.patches, llm_hidden * b * shape.patches]
    return LayerBytes(saved, outputs, pixels, [0.0, *[split] * cfg.layers, 0.0, 0.0],
                      [0.0, *[sliced] * cfg.layers, 0.0, 0.0], outputs[:-2] + [0.0, 0.0])
