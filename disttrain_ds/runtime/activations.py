"""Bytes autograd keeps for backward, per pipeline layer and per sample, from the model config.

One list per module, aligned with its pipeline layer list (``models/mllm.py``: encoder = its
layers, then the projector; LLM = embed, blocks, head; generator = the projector, then its
layers). Each family's record points at its formula (``Family.activation_layers``); the ViT and
Llama ones live here, the generators' with their families.
The counts follow what the layers save (checked against saved-tensor hooks on real layers in
``tests/unit/test_memory.py``): scaled-dot-product attention keeps q, k, v, its output and the
log-sum-exp (no score matrix), norms keep their input and statistics, MLPs their inputs and the
pre-activation. Per sample means the worst case the data allows: a full ``data.seq_len``
sequence, the most image patches ``data.max_images`` and ``data.image_sizes`` can place in it,
and ``data.gen_images[1]`` generated images.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

FP32 = 4
"""Bytes of the float32 tensors kept whatever the compute dtype (norm statistics, log-sum-exp, loss)."""


@dataclass(frozen=True)
class SampleShape:
    """The largest sample the recipe's data can produce, as the modules see it."""

    tokens: int
    """LLM sequence length (packed sequences are always full)."""
    images: int
    """Input images (encoder)."""
    patches: int
    """Encoder patches over all input images (each is one LLM token, so at most ``tokens``)."""
    gen_images: int
    """Images the generator produces (at least 1: an empty sample still runs one stand-in)."""
    audio_rows: int = 0
    """Audio-encoder output rows over all input clips (each is one LLM token, so at most ``tokens``);
    a clip of ``f`` log-mel frames makes ``f // 2``."""


def sample_shape(recipe) -> SampleShape:
    """The worst-case sample of ``recipe``'s ``data`` section."""
    from ..recipe_graph import encoder_of

    from ..recipe_graph import graph_of

    d, enc = recipe.data, encoder_of(recipe, "image")
    # Several generators: the shortest query run lets the most images into one sequence.
    gen = min((recipe.model.modules[n] for n in graph_of(recipe).generators), key=lambda c: c.query_tokens, default=None)
    per_image = (max(d.image_sizes) // enc.patch_size) ** 2 if d.image_sizes and enc is not None else 0
    patches = min(d.seq_len, d.max_images * per_image)
    images = min(d.max_images, -(-patches // per_image)) if per_image else 0
    gens = max(1, min(d.gen_images[1], d.seq_len // gen.query_tokens)) if gen is not None else 0
    audio = min(d.seq_len, d.max_audio * (d.audio_frames[-1] // 2)) if encoder_of(recipe, "audio") else 0
    return SampleShape(d.seq_len, images, patches, gens, audio)


@dataclass(frozen=True)
class LayerBytes:
    """Per-sample bytes of a module's pipeline layers, in layer order."""

    saved: list[float]
    """What each layer's autograd graph keeps for backward."""
    outputs: list[float]
    """What each layer returns (a pipeline stage keeps its last layer's output until backward)."""
    inputs: float
    """What the module's first layer takes in (a stage keeps the tensors it receives)."""
    sharded: list[float] = field(default_factory=list)
    """The part of each layer's ``saved`` that tensor parallelism splits (attention and MLP
    internals); the rest, and ``outputs`` and ``inputs``, is whole on every TP rank. Empty: all
    of it is replicated (the safe figure for a family that does not say)."""

    def on_rank(self, tp: int) -> list[float]:
        """Each layer's saved bytes on one of ``tp`` TP ranks."""
        split = self.sharded or [0.0] * len(self.saved)
        return [s - x + x / tp for s, x in zip(self.saved, split)]


def llm_layers(cfg, shape: SampleShape, b: int) -> LayerBytes:
    """LLM: embed, decoder blocks, head (norm + LM head + cross-entropy), at ``b`` bytes per element."""
    h, f, a, s, v = cfg.hidden_size, cfg.ffn_hidden, cfg.heads, shape.tokens, cfg.vocab_size
    d = h // a
    kv = cfg.kv_heads * d
    # Per token: RMSNorm input kept in float32 plus its normed output, twice (attention, MLP);
    # q, k, v after rotary, cos/sin, attention output; SwiGLU gate, up, silu(gate), down input.
    block = (6 * h + 2 * kv + 2 * d + 4 * f) * b + (2 * h + a + 2) * FP32
    # TP splits q, k, v, the attention output and log-sum-exp, and the MLP's hidden tensors; the
    # norms' inputs and outputs and cos/sin are whole on every rank.
    split = (4 * h + 2 * kv + 4 * f) * b + a * FP32
    head = 2 * h * b + (h + 1) * FP32 + v * FP32  # norm, LM-head input, float32 log-softmax
    saved = [9.0 * s, *[block * s] * cfg.layers, head * s]  # embed: token ids and image mask
    outputs = [h * b * s] * (cfg.layers + 1) + [(v + h) * b * s]  # the head returns logits and states
    return LayerBytes(saved, outputs, 8.0 * s + h * b * (shape.patches + shape.audio_rows),
                      [0.0, *[split * s] * cfg.layers, 0.0])


def encoder_layers(cfg, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """Encoder: patch embedding, ViT blocks, head (norm, CLS dropped), input projector; per sample."""
    e, fe, a, p = cfg.hidden_size, cfg.ffn_hidden, cfg.heads, cfg.patch_size
    tokens = shape.patches + shape.images  # one CLS token per image
    pixels = 3 * p * p * shape.patches * b  # the patches the convolution reads
    # Per token: two LayerNorm inputs, normed inputs of q/k/v and the MLP, q, k, v, attention
    # output, GELU input and fc2 input.
    block = ((8 * e + 2 * fe) * b + (a + 4) * FP32) * tokens
    split = ((4 * e + 2 * fe) * b + a * FP32) * tokens  # q, k, v, attention output, MLP hidden
    head = (e * b + 2 * FP32) * tokens
    projector = (e + 2 * llm_hidden) * b * shape.patches  # fc1 input, GELU input, fc2 input
    saved = [pixels, *[block] * cfg.layers, head, projector]
    outputs = [e * b * tokens] * (cfg.layers + 1) + [e * b * shape.patches, llm_hidden * b * shape.patches]
    return LayerBytes(saved, outputs, pixels, [0.0, *[split] * cfg.layers, 0.0, 0.0])


def generator_layers(cfg, llm_hidden: int, shape: SampleShape, b: int) -> LayerBytes:
    """U-Net generator: output projector, in, down blocks, mid, up blocks, out; per sample
    (the unet family's ``activation_layers``)."""
    from ..families.unet.estimates import activation_layers

    return activation_layers(cfg, llm_hidden, shape, b)


def module_layers(recipe, module: str, vocab_size: int) -> LayerBytes:
    """Per-sample bytes of each pipeline layer of ``module`` (``vocab_size``: the LLM's, resolved),
    from its family's ``activation_layers``."""
    from ..recipe_graph import graph_of, module_family

    m, shape = recipe.model, sample_shape(recipe)
    b = 2 if recipe.train.dtype == "bf16" else 4
    cfg, fam, llm = m.modules[module], module_family(recipe, module), m.modules[graph_of(recipe).llm]
    if fam.activation_layers is None:
        raise ValueError(f"family {fam.name} has no activation-memory formula (module {module})")
    if fam.role == "llm":
        cfg = replace(cfg, vocab_size=vocab_size)
    return fam.activation_layers(cfg, llm.hidden_size, shape, b)
