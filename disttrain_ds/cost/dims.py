"""Transformer shapes and the image encoder's forward FLOPs per image, without numpy or torch.

Light enough for the family records (read by recipe validation): an image encoder family prices
one image from here, and the cost model's encoder coefficients are the same terms.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerDims:
    """Shape of a transformer stack (ViT encoder or Llama backbone)."""

    layers: int
    """Number of transformer layers."""
    hidden: int
    """Model width."""
    ffn_hidden: int
    """MLP inner width."""
    heads: int
    """Query heads."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means equal to ``heads``."""
    gated_mlp: bool = False
    """Three MLP matrices (SwiGLU, Llama) instead of two (GELU MLP, ViT)."""
    head_dim: int = 0
    """Width of one attention head; 0 means ``hidden // heads`` with Q and O ``hidden`` wide."""

    def _q_kv_dims(self) -> tuple[int, int]:
        kv = self.kv_heads or self.heads
        if self.head_dim:
            return self.heads * self.head_dim, kv * self.head_dim
        return self.hidden, kv * (self.hidden // self.heads)

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of the Q/K/V/O projections and the MLP, all layers (Q and O
        are ``q_dim`` wide, K and V shrink with grouped-query attention; 2 FLOPs per weight)."""
        q_dim, kv_dim = self._q_kv_dims()
        attn = 2 * (2 * self.hidden * q_dim + 2 * self.hidden * kv_dim)
        mlp = 2 * (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden
        return float(self.layers * (attn + mlp))

    def flops_per_pair(self) -> float:
        """Forward FLOPs per attended query-key pair (QK^T and AV: 2 FLOPs per element of each
        query head), all layers."""
        return float(self.layers * 2 * 2 * self._q_kv_dims()[0])


def patch_embed_flops(patch_size: int, hidden: int, channels: int = 3) -> float:
    """Forward FLOPs per patch of a ViT's patch-embedding convolution."""
    return 2.0 * channels * patch_size * patch_size * hidden


def image_terms(dims: TransformerDims, patch_size: int, cls_token: bool = True, channels: int = 3) -> dict[str, float]:
    """``CostModel`` encoder coefficients (``enc_per_image``, ``enc_per_patch``, ``enc_per_patch_sq``)
    of a ViT-shaped encoder: one image of ``n`` patches costs ``enc_per_image + enc_per_patch * n +
    enc_per_patch_sq * n**2`` forward FLOPs (patch-embedding convolution per patch, linear layers per
    token, bidirectional attention per image; a CLS token is one more token)."""
    lin, pair = dims.linear_flops_per_token(), dims.flops_per_pair()
    embed = patch_embed_flops(patch_size, dims.hidden, channels)
    c = 1.0 if cls_token else 0.0
    # (n + c) tokens cost lin * (n + c) + pair * (n + c)^2, expanded in n (c is 0 or 1).
    return {"enc_per_image": c * (lin + pair), "enc_per_patch": lin + embed + 2 * c * pair, "enc_per_patch_sq": pair}


def image_flops(dims: TransformerDims, patch_size: int, cls_token: bool, patches: int, channels: int = 3) -> float:
    """Forward FLOPs of one image of ``patches`` patches (``image_terms``' formula)."""
    t = image_terms(dims, patch_size, cls_token, channels)
    return t["enc_per_image"] + t["enc_per_patch"] * patches + t["enc_per_patch_sq"] * patches * patches
