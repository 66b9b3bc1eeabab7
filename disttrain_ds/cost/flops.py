"""Training FLOPs of the MLLM modules: closed forms for the LLM, ViT and projectors,
measured counts (``torch.utils.flop_counter``) for the diffusion U-Net.

Conventions: one multiply-add is 2 FLOPs; only matmuls and convolutions are counted
(norms, softmax, activations and the embedding lookup are left out, as Megatron-LM and
timm do). Training FLOPs are derived from forward FLOPs by :func:`training_flops`, with no
activation recomputation.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain_ds.cost.backward import MODE_MULTIPLIER
from disttrain_ds.cost.dims import TransformerDims, image_flops
from disttrain_ds.models.vae import vae_kwargs


def training_flops(forward_flops: float, *, mode: str = "train") -> float:
    """FLOPs of one training pass given forward FLOPs: 3x ("train"), 2x ("frozen_passthrough")
    or 1x ("frozen")."""
    if forward_flops < 0:
        raise ValueError(f"forward_flops must be >= 0, got {forward_flops}")
    return float(forward_flops) * _multiplier(mode)


def _multiplier(mode: str) -> float:
    if mode not in MODE_MULTIPLIER:
        raise ValueError(f"mode must be one of {sorted(MODE_MULTIPLIER)}, got {mode!r}")
    return MODE_MULTIPLIER[mode]


def _positive(**kwargs: int) -> None:
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
    _positive(layers=layers, hidden=hidden, ffn_hidden=ffn_hidden, heads=heads,
              kv_heads=kv_heads, vocab=vocab)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        head_dim = hidden // heads
    _positive(head_dim=head_dim)
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
        _positive(doc_lens_item=n)
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
    _positive(seq_len=seq_len)
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
    _positive(layers=layers, hidden=hidden, ffn_hidden=ffn_hidden, patch_size=patch_size,
              channels=channels)
    if len(patches_per_image) == 0:
        raise ValueError("patches_per_image must be non-empty")
    for n in patches_per_image:
        _positive(patches_per_image_item=n)
    dims = TransformerDims(layers, hidden, ffn_hidden, heads=1)  # without GQA the head count changes no FLOPs
    return training_flops(sum(image_flops(dims, patch_size, include_cls, int(n), channels) for n in patches_per_image),
                          mode=mode)


def projector_flops_per_token(
    *, in_dim: int, hidden_dim: int, out_dim: int, mode: str = "train",
) -> float:
    """Training FLOPs per token of a 2-layer MLP projector (in -> hidden -> out)."""
    _positive(in_dim=in_dim, hidden_dim=hidden_dim, out_dim=out_dim)
    return training_flops(2.0 * (in_dim * hidden_dim + hidden_dim * out_dim), mode=mode)


# --------------------------------------------------------------------------- measured counts

_MEMORY_CACHE: dict[str, float] = {}


def clear_flops_cache() -> None:
    """Forget every measurement cached in this process (the disk cache is untouched)."""
    _MEMORY_CACHE.clear()


def _describe(value: Any) -> Any:
    """JSON-able description of an input: shape and dtype for tensors, repr otherwise."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return repr(value)


def _module_config(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):  # transformers
        return config.to_dict()
    if isinstance(config, Mapping):  # diffusers FrozenDict
        return dict(config)
    return repr(module)  # plain nn.Module: the printed architecture names every shape


def _stable_key(payload: Mapping[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def module_cache_key(module: nn.Module, example_inputs: tuple | dict, *, mode: str = "train") -> str:
    """Stable hash of (module class, config, input shapes, mode) used by the FLOPs cache."""
    _multiplier(mode)
    return _stable_key({
        "class": type(module).__qualname__,
        "config": _module_config(module),
        "params": sum(p.numel() for p in module.parameters()),
        "inputs": _describe(example_inputs),
        "mode": mode,
    })


def _cached(key: str, label: str, compute: Callable[[], float],
            cache_path: str | os.PathLike | None) -> float:
    if key in _MEMORY_CACHE:
        return _MEMORY_CACHE[key]
    disk: dict[str, Any] = {}
    if cache_path is not None and Path(cache_path).is_file():
        disk = json.loads(Path(cache_path).read_text() or "{}")
        if key in disk:
            _MEMORY_CACHE[key] = float(disk[key]["flops"])
            return _MEMORY_CACHE[key]
    flops = float(compute())
    _MEMORY_CACHE[key] = flops
    if cache_path is not None:
        disk[key] = {"flops": flops, "what": label}
        path = Path(cache_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename so a concurrent reader never sees a half-written file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(disk, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    return flops


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    elif hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _count(module: nn.Module, example_inputs: tuple | dict, mode: str) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    params = list(module.parameters())
    saved = [p.requires_grad for p in params]
    saved_grads = [p.grad for p in params]
    if isinstance(example_inputs, Mapping):
        inputs = dict(example_inputs)
        floats = {k: v for k, v in inputs.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point()}
    else:
        inputs = list(example_inputs)
        floats = {i: v for i, v in enumerate(inputs)
                  if isinstance(v, torch.Tensor) and v.is_floating_point()}
    input_grads = [(v, v.grad) for v in floats.values() if v.is_leaf]
    wrt: list[torch.Tensor] = []
    try:
        for p in params:
            p.requires_grad_(mode == "train")
        wrt += [p for p in params if p.requires_grad]
        for k, v in floats.items():
            if mode == "frozen_passthrough":
                # Upper bound: gradients flow back to every floating-point input.
                inputs[k] = v = v.detach().requires_grad_(True)
            if v.requires_grad:
                wrt.append(v)
        counter = FlopCounterMode(display=False)
        # The fused CPU attention kernel has no FLOP formula; the math path is counted.
        with sdpa_kernel(SDPBackend.MATH), counter, torch.set_grad_enabled(mode != "frozen"):
            out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
            if mode != "frozen":
                outs = [t for t in _tensors(out) if t.requires_grad]
                if not outs or not wrt:
                    raise ValueError(f"example_inputs give nothing to differentiate in mode {mode!r}")
                # (autograd.grad clashes with FlopCounterMode's module hooks.)
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs], inputs=wrt)
        return float(counter.get_total_flops())
    finally:
        for p, flag, grad in zip(params, saved, saved_grads):
            p.requires_grad_(flag)
            p.grad = grad  # leave the caller's gradients as they were
        for v, grad in input_grads:
            v.grad = grad


def measure_module_flops(
    module: nn.Module, example_inputs: tuple | dict, *, mode: str = "train",
    cache_path: str | os.PathLike | None = None,
) -> float:
    """Measured FLOPs of one forward (+ backward) pass of ``module`` on ``example_inputs``.

    Runs under ``FlopCounterMode``; build the module and inputs on the meta device to
    measure without allocating memory or computing anything (CPU works too). ``mode``:
    "train" = forward + backward with every parameter trained; "frozen_passthrough" =
    forward + backward to the floating-point inputs only; "frozen" = forward only.
    Results are cached in memory and, if ``cache_path`` is given, in that JSON file,
    keyed by :func:`module_cache_key`.
    """
    if not isinstance(example_inputs, (tuple, dict)):
        raise ValueError(f"example_inputs must be a tuple or dict, got {type(example_inputs).__name__}")
    key = module_cache_key(module, example_inputs, mode=mode)
    label = f"{type(module).__name__} {mode} {json.dumps(_describe(example_inputs))}"
    return _cached(key, label, lambda: _count(module, example_inputs, mode), cache_path)


def unet_flops(
    config: Mapping[str, Any], *, batch: int, resolution: int, cond_tokens: int,
    mode: str = "train", cache_path: str | os.PathLike | None = None,
) -> float:
    """Measured FLOPs of a diffusers ``UNet2DConditionModel`` built from ``config`` on the
    meta device, for ``batch`` square images of ``resolution`` pixels conditioned on
    ``cond_tokens`` vectors. Cached by (config, shapes, mode) before the model is built."""
    _positive(batch=batch, resolution=resolution, cond_tokens=cond_tokens)
    _multiplier(mode)
    shapes = {"batch": batch, "resolution": resolution, "cond_tokens": cond_tokens}
    key = _stable_key({"class": "UNet2DConditionModel", "config": dict(config),
                       "inputs": shapes, "mode": mode})

    def compute() -> float:
        from diffusers import UNet2DConditionModel

        with torch.device("meta"):
            unet = UNet2DConditionModel(**config)
            cfg = unet.config
            cond_dim = cfg.cross_attention_dim
            inputs = {
                "sample": torch.empty(batch, cfg.in_channels, resolution, resolution),
                "timestep": torch.zeros(batch, dtype=torch.long),
                "encoder_hidden_states": torch.empty(batch, cond_tokens, cond_dim),
            }
        return _count(unet, inputs, mode)

    return _cached(key, f"UNet2DConditionModel {mode} {shapes}", compute, cache_path)


def vae_encode_flops(cfg, side: int, cache_path: str | os.PathLike | None = None) -> float:
    """Measured forward FLOPs of the frozen VAE (``models/vae_config.py::VaeConfig``) encoding one
    ``side`` x ``side`` RGB image to its posterior (encoder and quant conv; no backward: it is
    frozen and nothing upstream trains). Reported apart from the model FLOPs that MFU counts."""
    _positive(side=side)
    kwargs = vae_kwargs(cfg)
    key = _stable_key({"class": "AutoencoderKL.encode", "config": kwargs, "side": side})

    def compute() -> float:
        from diffusers import AutoencoderKL

        with torch.device("meta"):
            vae = AutoencoderKL(**kwargs)
            encode = nn.Sequential(vae.encoder, vae.quant_conv) if vae.quant_conv is not None else vae.encoder
            image = torch.empty(1, 3, side, side)
        return _count(encode, (image,), "frozen")

    return _cached(key, f"AutoencoderKL.encode {side}px", compute, cache_path)
