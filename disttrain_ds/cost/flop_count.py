"""Measured FLOPs (``torch.utils.flop_counter``) of modules with no closed form here: the diffusion
U-Net and the frozen VAE encoder, built on the meta device; cached in memory and on disk."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain_ds.cost.flops import mode_multiplier, require_positive
from disttrain_ds.models.tensor_tree import tensors_in
from disttrain_ds.models.vae import vae_kwargs

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
    mode_multiplier(mode)
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
                outs = [t for t in tensors_in(out) if t.requires_grad]
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
    require_positive(batch=batch, resolution=resolution, cond_tokens=cond_tokens)
    mode_multiplier(mode)
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
    require_positive(side=side)
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
