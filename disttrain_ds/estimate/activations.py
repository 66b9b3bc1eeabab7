"""Activation bytes of a recipe's modules: the worst-case sample its data allows, and each
module's per-layer bytes from its family's formula (``Family.activation_layers``; the types in
``cost/activations.py``, the formulas in each family's folder).

One list per module, aligned with its pipeline layer list (``mllm/model.py``: encoder = its
layers, then the projector; LLM = embed, blocks, head; generator = the projector, then its
layers). Per sample means the worst case the data allows: a full sequence (``data.max_seq_len``
where set, else ``data.seq_len``), the
most image patches ``data.max_images`` and ``data.image_sizes`` can place in it, and
``data.gen_images[1]`` generated images.
"""

from __future__ import annotations

from dataclasses import replace

from disttrain_ds.cost.activations import LayerBytes, SampleShape
from disttrain_ds.data.config import longest_seq
from disttrain_ds.recipe.graph import encoder_of, graph_of, module_family

__all__ = ["LayerBytes", "SampleShape", "module_layers", "sample_shape"]


def sample_shape(recipe) -> SampleShape:
    """The worst-case sample of ``recipe``'s ``data`` section."""
    d, enc = recipe.data, encoder_of(recipe, "image")
    # Several generators: the shortest query run lets the most images into one sequence.
    gen = min((recipe.model.modules[n] for n in graph_of(recipe).generators), key=lambda c: c.query_tokens, default=None)
    # A sequence of its own length (data.max_seq_len) holds k x seq_len tokens and k times the limits.
    n, k = longest_seq(d), longest_seq(d) // d.seq_len
    per_image = (max(d.image_sizes) // enc.patch_size) ** 2 if d.image_sizes and enc is not None else 0
    patches = min(n, k * d.max_images * per_image)
    images = min(k * d.max_images, -(-patches // per_image)) if per_image else 0
    gens = max(1, min(k * d.gen_images[1], n // gen.query_tokens)) if gen is not None else 0
    audio = min(n, k * d.max_audio * (d.audio_frames[-1] // 2)) if encoder_of(recipe, "audio") else 0
    return SampleShape(n, images, patches, gens, audio)


def module_layers(recipe, module: str, vocab_size: int) -> LayerBytes:
    """Per-sample bytes of each pipeline layer of ``module`` (``vocab_size``: the LLM's, resolved),
    from its family's ``activation_layers``."""
    m, shape = recipe.model, sample_shape(recipe)
    b = recipe.train.value_bytes
    cfg, fam, llm = m.modules[module], module_family(recipe, module), m.modules[graph_of(recipe).llm]
    if fam.activation_layers is None:
        raise ValueError(f"family {fam.name} has no activation-memory formula (module {module})")
    if fam.role == "llm":
        cfg = replace(cfg, vocab_size=vocab_size)
    return fam.activation_layers(cfg, llm.hidden_size, shape, b)
