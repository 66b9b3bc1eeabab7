"""Training FLOPs of the MLLM modules: closed forms for the LLM, ViT and projectors (no torch:
recipe checks and the planner read them); measured counts for the diffusion U-Net and the VAE
are in ``flop_count.py``.

Conventions: one multiply-add is 2 FLOPs; only matmuls and convolutions are counted
(norms, softmax, activations and the embedding lookup are left out, as Megatron-LM and
timm do). Training FLOPs are derived from forward FLOPs by :func:`training_flops`, with no
activation recomputation.
"""

from __future__ import annotations

from collections.abc import Sequence

from disttrain_ds.cost.backward import MODE_MULTIPLIER
from disttrain_ds.cost.dims import TransformerDims, image_flops


def training_flops(forward_flops: float, *, mode: str = "train") -> float:
    """FLOPs of one training pass given forward FLOPs: 3x ("train"), 2x ("frozen_passthrough")
    or 1x ("frozen")."""
    if forward_flops < 0:
        raise ValueError(f"forward_flops must be >= 0, got {forward_flops}")
    return float(forward_flops) * mode_multiplier(mode)


def mode_multiplier(mode: str) -> float:
    """What training FLOPs are of forward FLOPs in ``mode``; an unknown mode is refused."""
    if mode not in MODE_MULTIPLIER:
        raise ValueError(f"mode must be one of {sorted(MODE_MULTIPLIER)}, got {mode!r}")
    return MODE_MULTIPLIER[mode]


def require_positive(**kwargs: int) -> None:
    """Refuse (by name) any value that is not a positive integer."""
    for name, value in kwargs.items():
        if int(value) != value or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------- LLM


def _llm_forward_parts(
    *, layers: int, hidden: int, ffn_hidden: int, heads: int, kv_heads: int, vocab: int,
    gated_mlp: bool, head_dim: int | None,
) -> tuple[float, float]:
    """(forward FLOPs per token of all linear layers incl. LM head, forward FLOPs per
    attended query-key pair summed over layers)."""
    require_positive(layers=layers, hidden=hidden, ffn_hidden=ffn_hidden, heads=heads,
              kv_heads=kv_heads, vocab=vocab)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        head_dim = hidden // heads
    require_positive(head_dim=head_dim)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    dims = TransformerDims(layers, hidden, ffn_hidden, heads, kv_heads, gated_mlp, head_dim)
    return dims.linear_flops_per_token() + 2.0 * hidden * vocab, dims.flops_per_pair()  # + LM head


def _attended_pairs(length: int, causal: bool) -> int:
    # Causal: token i attends to i+1 keys (diagonal included) -> L(L+1)/2 pairs.
    return length * (length + 1) // 2 if causal else length * length


def llm_flops_packed(
    *, layers: int, hidden: int, ffn_hidden: int, heads: int, kv_heads: int, vocab: int,
    doc_lens: Sequence[int], gated_mlp: bool = True, causal: bool = True,
    head_dim: int | None = None, mode: str = "train",
) -> float:
    """Training FLOPs of one packed sequence whose document boundaries are known.

    Linear layers and the LM head count per token; attention counts per document (no
    attention across documents), so a sequence of many short documents costs less than
    one long document of the same length. ``causal=True`` counts the L(L+1)/2 query-key
    pairs a causal mask keeps; ``causal=False`` counts all L^2 pairs (Megatron-LM's
    convention). Padding tokens are not counted unless passed as a document.
    """
    if len(doc_lens) == 0:
        raise ValueError("doc_lens must be non-empty")
    for n in doc_lens:
        require_positive(doc_lens_item=n)
    linear, per_pair = _llm_forward_parts(
        layers=layers, hidden=hidden, ffn_hidden=ffn_hidden, heads=heads, kv_heads=kv_heads,
        vocab=vocab, gated_mlp=gated_mlp, head_dim=head_dim)
    pairs = sum(_attended_pairs(int(n), causal) for n in doc_lens)
    forward = linear * sum(doc_lens) + per_pair * pairs
    return training_flops(forward, mode=mode)


def llm_flops_per_token(
    *, layers: int, hidden: int, ffn_hidden: int, heads: int, kv_heads: int, vocab: int,
    seq_len: int, gated_mlp: bool = True, causal: bool = True, head_dim: int | None = None,
    mode: str = "train",
) -> float:
    """Training FLOPs per token of a decoder-only LLM on one unpacked sequence of seq_len.

    Counts Q/K/V/O projections (K/V sized ``kv_heads * head_dim``), the MLP (3 matrices if
    ``gated_mlp`` else 2), attention scores and weighted sum, and the LM head.
    Attention is causal by default (the exact causal half, (seq_len+1)/2 keys per query on
    average); ``causal=False`` counts full attention as Megatron-LM's formula does.
    """
    require_positive(seq_len=seq_len)
    total = llm_flops_packed(
        layers=layers, hidden=hidden, ffn_hidden=ffn_hidden, heads=heads, kv_heads=kv_heads,
        vocab=vocab, doc_lens=[seq_len], gated_mlp=gated_mlp, causal=causal,
        head_dim=head_dim, mode=mode)
    return total / seq_len


# --------------------------------------------------------------------------- ViT / projector


def vit_flops(
    *, layers: int, hidden: int, ffn_hidden: int, patches_per_image: Sequence[int],
    patch_size: int, channels: int = 3, include_cls: bool = True, mode: str = "train",
) -> float:
    """Training FLOPs of a ViT encoder over the images of one step.

    ``patches_per_image`` lists each image's patch count (variable resolution allowed).
    Counts the patch-embedding conv (per patch), the per-token linear layers (Q, K, V, O
    and a 2-matrix MLP) and bidirectional attention per image (tokens squared). The
    CLS token is one extra token per image; no pooler or classifier head.
    """
    require_positive(layers=layers, hidden=hidden, ffn_hidden=ffn_hidden, patch_size=patch_size,
              channels=channels)
    if len(patches_per_image) == 0:
        raise ValueError("patches_per_image must be non-empty")
    for n in patches_per_image:
        require_positive(patches_per_image_item=n)
    dims = TransformerDims(layers, hidden, ffn_hidden, heads=1)  # without GQA the head count changes no FLOPs
    return training_flops(sum(image_flops(dims, patch_size, include_cls, int(n), channels) for n in patches_per_image),
                          mode=mode)


def projector_flops_per_token(
    *, in_dim: int, hidden_dim: int, out_dim: int, mode: str = "train",
) -> float:
    """Training FLOPs per token of a 2-layer MLP projector (in -> hidden -> out)."""
    require_positive(in_dim=in_dim, hidden_dim=hidden_dim, out_dim=out_dim)
    return training_flops(2.0 * (in_dim * hidden_dim + hidden_dim * out_dim), mode=mode)
