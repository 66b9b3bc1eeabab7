"""Per-sample cost model of the MLLM modules, by kind: image encoder, audio encoder, LLM, generator.

One :class:`CostModel` is shared by data reordering, the pipeline simulator, the planner and
emulated compute. Costs are forward costs in the coefficients' unit: FLOPs for a model built
by :meth:`CostModel.from_dims`, milliseconds after :meth:`CostModel.in_ms` or when fitted to
measured times with :meth:`CostModel.fit`. A training pass costs ``1 + backward_factor`` times
the forward.

* encoder (ViT), per input image of ``n`` patches: ``enc_per_image + enc_per_patch * n +
  enc_per_patch_sq * n**2`` (linear layers grow with ``n``, self-attention with ``n**2``);
* audio encoder (Whisper), per input clip of ``f`` log-mel frames: ``aud_per_clip +
  aud_per_frame * f + aud_per_frame_sq * f**2`` (convolutions and linear layers grow with ``f``,
  self-attention over its ``f / 2`` rows with ``f**2``; the family's ``cost_terms``);
* LLM, per packed sequence: ``llm_per_sequence + llm_per_token * seq_len +
  llm_per_doc_token_sq * sum(d**2 for d in doc_lens)`` (attention stays within a document);
* generator (diffusion U-Net), per generated image with ``t = (resolution / gen_downsample)**2``
  latent pixels: ``gen_per_image + gen_per_latent * t + gen_per_latent_sq * t**2``.

FLOP conventions follow :mod:`disttrain_ds.cost.flops`: a multiply-add is 2 FLOPs, only
matmuls and convolutions count, causal attention keeps L(L+1)/2 query-key pairs.

A module graph maps each of its modules to one of these kinds (``cost.graph_costs.GraphCosts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from scipy.optimize import nnls

from disttrain_ds.cost.backward import BACKWARD_FACTOR
from disttrain_ds.cost.dims import TransformerDims, image_terms
from disttrain_ds.samples import SampleStats

Module = Literal["encoder", "audio", "llm", "generator"]
"""Cost kinds: ``encoder`` (an image encoder, by input images), ``audio`` (an audio encoder, by
input clips), ``llm``, ``generator``."""


@dataclass(frozen=True)
class UNetDims:
    """Shape of a latent-diffusion U-Net, coarse enough for FLOP counting."""

    channels: tuple[int, ...]
    """Channels per resolution level, finest first (level l has 4**-l of the latent pixels)."""
    attention: tuple[bool, ...]
    """Whether each level has transformer (self + cross attention) blocks."""
    blocks_down: int = 2
    """ResNet (+ transformer) blocks per level on the down path."""
    blocks_up: int = 3
    """ResNet (+ transformer) blocks per level on the up path."""

    def per_latent_flops(self) -> tuple[float, float]:
        """(forward FLOPs per latent pixel, per pair of latent pixels) of one denoising step.

        A ResNet block is two 3x3 convolutions; a transformer block is self-attention
        projections (4c^2), cross-attention Q/O (2c^2) and a GEGLU MLP (12c^2) per pixel.
        Down-/up-sampling convolutions, the text K/V projections and the mid block are left out.
        """
        linear = pairs = 0.0
        blocks = self.blocks_down + self.blocks_up
        for level, (ch, attn) in enumerate(zip(self.channels, self.attention)):
            share = 4.0 ** -level
            per_px = 2 * 2 * 9 * ch * ch  # two 3x3 convs
            if attn:
                per_px += 2 * (4 + 2 + 12) * ch * ch
                pairs += blocks * 2 * 2 * ch * share * share
            linear += blocks * per_px * share
        return linear, pairs


VIT_HUGE_14 = TransformerDims(layers=32, hidden=1280, ffn_hidden=5120, heads=16)
"""ViT-Huge/14, the paper's encoder (0.63B parameters)."""
LLAMA_PRESETS = {
    "llama3-7b": TransformerDims(32, 4096, 11008, 32, 32, gated_mlp=True),
    "llama3-13b": TransformerDims(40, 5120, 13824, 40, 40, gated_mlp=True),
    "llama3-70b": TransformerDims(80, 8192, 28672, 64, 8, gated_mlp=True),
}
"""LLM backbones of the paper's model table (arXiv 2408.04275)."""
SD21_UNET = UNetDims(channels=(320, 640, 1280, 1280), attention=(True, True, True, False))
"""Stable Diffusion 2.1's U-Net, the paper's generator."""


@dataclass(frozen=True)
class CostModel:
    """Forward cost of one sample in each module; see the module docstring for the formulas."""

    enc_per_patch: float
    """Encoder cost per patch (linear layers, patch embedding)."""
    enc_per_patch_sq: float
    """Encoder cost per squared patch count of an image (self-attention)."""
    llm_per_token: float
    """LLM cost per sequence position, padding included (linear layers, LM head, and the
    diagonal half of causal attention)."""
    llm_per_doc_token_sq: float
    """LLM cost per squared document length (attention within each packed document)."""
    gen_per_latent: float
    """Generator cost per latent pixel of a generated image (convolutions, projections)."""
    gen_per_latent_sq: float
    """Generator cost per squared latent-pixel count of a generated image (self-attention)."""
    enc_per_image: float = 0.0
    """Encoder cost per input image independent of its size (e.g. a CLS token, launches)."""
    llm_per_sequence: float = 0.0
    """LLM cost per sequence independent of its length."""
    gen_per_image: float = 0.0
    """Generator cost per generated image independent of its resolution."""
    aud_per_clip: float = 0.0
    """Audio encoder cost per input clip independent of its length."""
    aud_per_frame: float = 0.0
    """Audio encoder cost per log-mel frame of a clip (convolutions, linear layers)."""
    aud_per_frame_sq: float = 0.0
    """Audio encoder cost per squared frame count of a clip (self-attention over its rows)."""
    gen_downsample: int = 8
    """Pixels per latent pixel along each side (the VAE's downsampling factor)."""
    backward_factor: float = BACKWARD_FACTOR
    """Backward cost as a multiple of forward (``cost/backward.py``: 2 for a trained module, 1 for
    a frozen one that still passes gradients upstream, 0 for frozen and last)."""

    # ----------------------------------------------------------------- per-sample costs

    def encoder_cost(self, s: SampleStats) -> float:
        """Forward cost of encoding all input images of ``s``."""
        n = np.asarray(s.image_patches, dtype=np.float64)
        per_image = self.enc_per_image + self.enc_per_patch * n + self.enc_per_patch_sq * n * n
        return float(per_image.sum())

    def audio_cost(self, s: SampleStats) -> float:
        """Forward cost of encoding all input audio clips of ``s``."""
        return float(np.dot(_coeffs(self, "audio"), _features("audio", s, self.gen_downsample)))

    def llm_cost(self, s: SampleStats) -> float:
        """Forward cost of the LLM over the packed sequence of ``s`` (one document if unknown)."""
        docs = np.asarray(s.doc_lens or (s.seq_len,), dtype=np.float64)
        return float(self.llm_per_sequence + self.llm_per_token * s.seq_len
                     + self.llm_per_doc_token_sq * (docs * docs).sum())

    def generator_cost(self, s: SampleStats, k: int = 0) -> float:
        """Forward cost of one denoising step for every image the ``k``-th generator makes for ``s``."""
        return float(np.dot(_coeffs(self, "generator"), _gen_features(*s.gen(k), self.gen_downsample)))

    def module_cost(self, module: Module, s: SampleStats) -> float:
        """Forward cost of ``s`` in a module of kind ``module`` (``Module``)."""
        if module not in TERMS:
            raise ValueError(f"module must be one of {sorted(TERMS)}, got {module!r}")
        return {"encoder": self.encoder_cost, "audio": self.audio_cost, "llm": self.llm_cost,
                "generator": self.generator_cost}[module](s)

    def costs(self, samples: Sequence[SampleStats]) -> np.ndarray:
        """``[n, 3]`` forward costs (image encoder, llm, generator) of each sample (a graph's
        modules by name, audio encoders included: ``cost.graph_costs.GraphCosts.costs``)."""
        return np.array([[self.encoder_cost(s), self.llm_cost(s), self.generator_cost(s)]
                         for s in samples], dtype=np.float64).reshape(-1, 3)

    def train_cost(self, s: SampleStats) -> float:
        """Forward plus backward cost of ``s`` through every kind of module."""
        fwd = self.encoder_cost(s) + self.audio_cost(s) + self.llm_cost(s) + self.generator_cost(s)
        return fwd * (1.0 + self.backward_factor)

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_dims(cls, encoder: TransformerDims, llm: TransformerDims, generator: UNetDims, *,
                  enc_patch_size: int = 14, vocab_size: int = 128256, causal: bool = True,
                  enc_cls_token: bool = True, gen_downsample: int = 8) -> "CostModel":
        """Coefficients in forward FLOPs from module shapes.

        Encoder: patch-embedding conv + linear layers per patch, full attention per image (the
        CLS token folded into the per-image and per-patch terms). LLM: linear layers + LM head
        per token; causal attention's L(L+1)/2 pairs split into the per-token and squared
        terms. Generator: one U-Net denoising step (:meth:`UNetDims.per_latent_flops`).
        """
        for name, v in (("enc_patch_size", enc_patch_size), ("vocab_size", vocab_size),
                        ("gen_downsample", gen_downsample)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        l_lin = llm.linear_flops_per_token() + 2.0 * llm.hidden * vocab_size  # + LM head
        l_pair = llm.flops_per_pair()
        g_lin, g_pair = generator.per_latent_flops()
        return cls(
            **image_terms(encoder, enc_patch_size, enc_cls_token),
            llm_per_token=l_lin + (l_pair / 2 if causal else 0.0),
            llm_per_doc_token_sq=l_pair / 2 if causal else l_pair,
            gen_per_latent=g_lin, gen_per_latent_sq=g_pair, gen_downsample=gen_downsample)

    @classmethod
    def paper_mllm(cls, llm: str = "llama3-7b") -> "CostModel":
        """ViT-Huge/14 + a paper Llama backbone (``llama3-7b|13b|70b``) + SD 2.1, in FLOPs."""
        if llm not in LLAMA_PRESETS:
            raise ValueError(f"llm must be one of {sorted(LLAMA_PRESETS)}, got {llm!r}")
        return cls.from_dims(VIT_HUGE_14, LLAMA_PRESETS[llm], SD21_UNET)

    def in_ms(self, flops_per_s: float) -> "CostModel":
        """The same model with costs in milliseconds at a sustained ``flops_per_s`` (e.g.
        312e12 * MFU for an A800 in bf16). Only meaningful for a model in FLOPs."""
        if not flops_per_s > 0:
            raise ValueError(f"flops_per_s must be > 0, got {flops_per_s}")
        k = 1e3 / flops_per_s
        return replace(self, **{name: getattr(self, name) * k for name in _COEFFS})

    def fit(self, module: Module, samples: Sequence[SampleStats], measured: Sequence[float],
            intercept: bool = True) -> "CostModel":
        """Refit one module's coefficients to measured forward costs (non-negative least squares).

        ``measured[i]`` is the forward cost (e.g. ms) of ``samples[i]`` in ``module``. With
        ``intercept=False`` the per-item constant is pinned to 0. The other modules keep
        their coefficients, so fit all three from measurements in the same unit.
        """
        if module not in TERMS:
            raise ValueError(f"module must be one of {sorted(TERMS)}, got {module!r}")
        y = np.asarray(measured, dtype=np.float64)
        if y.ndim != 1 or len(y) != len(samples) or len(y) == 0:
            raise ValueError(f"measured must be 1-D with one value per sample ({len(samples)})")
        names = TERMS[module]
        x = np.array([_features(module, s, self.gen_downsample) for s in samples])
        if not intercept:
            x, names = x[:, 1:], names[1:]
        scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)  # conditioning only
        coef, _ = nnls(x / scale, y)
        out = {name: float(v) for name, v in zip(names, coef / scale)}
        if not intercept:
            out[TERMS[module][0]] = 0.0
        return replace(self, **out)


TERMS: dict[str, tuple[str, str, str]] = {  # per-item, linear and squared coefficients of each cost kind
    "encoder": ("enc_per_image", "enc_per_patch", "enc_per_patch_sq"),
    "audio": ("aud_per_clip", "aud_per_frame", "aud_per_frame_sq"),
    "llm": ("llm_per_sequence", "llm_per_token", "llm_per_doc_token_sq"),
    "generator": ("gen_per_image", "gen_per_latent", "gen_per_latent_sq"),
}
_COEFFS = tuple(name for names in TERMS.values() for name in names)


def _coeffs(model: CostModel, module: str) -> list[float]:
    """(per-item, linear, squared) coefficients of ``module`` in ``model``."""
    return [getattr(model, name) for name in TERMS[module]]


def _features(module: str, s: SampleStats, downsample: int) -> list[float]:
    """Values multiplying (per-item, linear, squared) coefficients of ``module`` for ``s``."""
    if module in ("encoder", "audio"):
        n = np.asarray(s.image_patches if module == "encoder" else s.audio_frames, dtype=np.float64)
        return [float(len(n)), float(n.sum()), float((n * n).sum())]
    if module == "llm":
        docs = np.asarray(s.doc_lens or (s.seq_len,), dtype=np.float64)
        return [1.0, float(s.seq_len), float((docs * docs).sum())]
    return _gen_features(*s.gen(0), downsample)


def _gen_features(images: int, side: int, downsample: int) -> list[float]:
    """(images, images x latent pixels, images x latent pixels^2) of one generator's targets."""
    t = (side / downsample) ** 2 if images > 0 else 0.0
    return [float(images), images * t, images * t * t]


def flops_to_ms(flops: float, peak_flops_per_s: float, mfu: float = 1.0) -> float:
    """Milliseconds to execute ``flops`` at ``mfu`` of ``peak_flops_per_s``."""
    if not peak_flops_per_s > 0:
        raise ValueError(f"peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return 1e3 * flops / (peak_flops_per_s * mfu)
