"""What a model family tells the rest of the system: one record per family, no torch.distributed.

A family (ViT, Llama, Qwen2, U-Net, ...) is everything that depends on the network's code: how
its config becomes pipeline layers, which linears tensor parallelism splits, how Hugging Face /
diffusers checkpoint keys map onto its layers, which sizes a TP degree must divide, and how many
FLOPs a step costs. The runtime, checkpoint loader, recipe validation and MFU meter ask the
family instead of switching on module names, so adding a family is one folder and one line in
``families/__init__.py``.

The record itself is light (no torch): recipe validation reads it without importing any network
code; the layers and the TP plan live in the family's ``model`` module, imported when needed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from disttrain_ds.cost.activations import LayerBytes, SampleShape
    from disttrain_ds.models.layers import LayerDef


@dataclass(frozen=True)
class BuildContext:
    """What a family's layer builder needs beyond its own config."""

    module: str
    """The module's name in the graph (part of every layer's seed and checkpoint key)."""
    seed: int
    """Model initialisation seed shared by all layouts."""
    llm_hidden: int
    """Width of the LLM's hidden states (what encoders project to and generators read)."""
    image_token: int = -1
    """Token id of an image placeholder (LLM families)."""
    placeholders: tuple[int, ...] = ()
    """LLM families: the placeholder token id each upstream encoder's rows fill, in the order the
    encoders' tensors follow the token ids into the first layer; empty: ``(image_token,)``."""


@dataclass(frozen=True)
class Family:
    """One model family: its role, config type, presets and the formulas that depend on its code."""

    name: str
    """Recipe value of ``model.<module>.family``."""
    role: str
    """encoder | llm | generator: where in the graph a module of this family may sit."""
    config_type: type
    """The dataclass of ``model.<module>`` for this family."""
    presets: dict[str, dict]
    """Named sizes (``model.<module>.preset``); each maps config fields to values."""
    model: str
    """Module defining ``layers(cfg, ctx) -> list[LayerDef]`` (ordered pipeline layers) and
    ``TP_PLAN``: (submodule class, {linear path: col | row | col_gather}) pairs."""
    width: Callable[[Any], int]
    """Width at the module's LLM-side boundary: an encoder's output features, the LLM's hidden
    size, a generator's conditioning width (the projectors map between these)."""
    width_key: str
    """The config field ``width`` reads (named in tensor-parallel errors about the projector)."""
    layer_count: Callable[[Any], int]
    """Pipeline layers ``layers`` returns for a config (what PP may split), without building them."""
    tp_sizes: Callable[[Any, str, int], list[tuple[str, int]]]
    """(cfg, key prefix ``model.<module>``, LLM hidden width) -> (recipe key, size) pairs a
    tensor-parallel degree must divide in the family's own layers (projectors are checked apart)."""
    problems: Callable[[Any, str], list[tuple[str, str]]] = lambda cfg, prefix: []
    """(cfg, key prefix) -> (recipe key, message) for each size rule the config breaks (beyond
    "every integer is >= 1", which recipe validation checks for all families)."""
    hf_rules: Sequence[tuple[str, str]] = ()
    """(regex on a Hugging Face / diffusers checkpoint key, replacement giving ``layer/param``)."""
    hf_formats: str = ""
    """The checkpoint layouts ``hf_rules`` read, for messages."""
    image_flops: Callable[[Any, str], float] | None = None
    """Generators: (cfg, mode train | frozen | frozen_passthrough) -> training FLOPs of one generated
    image in the family's own layers (the output projector is counted apart); what MFU reads."""
    activation_layers: Callable[[Any, int, SampleShape, int], LayerBytes] | None = None
    """(cfg, LLM hidden width, worst-case sample, bytes per element) -> per-sample activation bytes
    of every pipeline layer of the module, its projector included (an LLM's cfg comes with its
    vocabulary resolved); what the memory estimate reads. None: no formula yet."""
    cost_terms: Callable[[Any], dict[str, float]] | None = None
    """Encoders and generators: cfg -> the ``CostModel`` fields of the module's cost kind, in forward
    FLOPs of its own layers: an image encoder's (``enc_per_image``, ``enc_per_patch``,
    ``enc_per_patch_sq``) of one image, an audio encoder's (``aud_per_clip``, ``aud_per_frame``,
    ``aud_per_frame_sq``) of one clip, a generator's (``gen_per_image``, ``gen_per_latent``,
    ``gen_per_latent_sq``, ``gen_downsample``) of one generated image. What data reordering,
    balance, emulation and the profiler's draws read."""
    vocab_params: Sequence[str] = ()
    """``layer/param`` keys whose rows are the vocabulary: an imported checkpoint with fewer rows
    (a tokenizer with extra special ids) grows them (``mllm/weights.py::grow_vocab``)."""
    item_size: Callable[[Any, Any], int] | None = None
    """Encoders: (cfg, one input tensor of the sample field ``modality`` names) -> its size in the
    unit the family's formulas count: an image's patches, a clip's log-mel frames."""
    item_flops: Callable[[Any, int], float] | None = None
    """Encoders: (cfg, item size) -> forward FLOPs of one input item in the family's own layers (the
    input projector is counted apart; ``cost_terms``' formula); what MFU and the profiler read."""
    rows: Callable[[Any, int], int] | None = None
    """Encoders: (cfg, item size) -> output rows (LLM tokens) of one input item."""
    checkpoint_fields: Callable[[dict, str], dict[str, Any]] | None = None
    """A checkpoint directory's ``config.json`` (as a dict; the str names the file in errors) ->
    this family's section fields it fixes; a one-line ConfigError for a setting the family cannot
    reproduce. None: the family reads no config.json (the recipe gives the shapes)."""
    modality: str = ""
    """Encoders: what the module reads (image | audio): which sample field feeds it and which
    placeholder token its output rows fill in the LLM's sequence."""
    blocks: Callable[[Any], int] | None = None
    """Image encoders: transformer layers one forward runs (what MFU and the cost model price);
    None: the config's ``layers``."""
    signed: tuple[str, ...] = ()
    """Integer config fields that may be zero or negative (an LLM's ``vocab_size``: 0 takes the
    tokenizer's; a tower's ``feature_layer``: -2 counts from the end); ``problems`` checks them.
    Every other integer field must be >= 1."""
    sp_heads: Callable[[Any], tuple[int, int]] | None = None
    """cfg -> (query heads, KV heads) of its attention layers, which sequence parallelism
    (``parallel.<module>.sp``) splits among its ranks; None: the family's layers have no SP path."""
    sliced_tp: bool = False
    """Whether the family's blocks have a path on sequence slices under tensor parallelism
    (``parallel.<module>.tp_overlap``, ``parallel/tp_sequence.py``): each TP rank keeps a slice of
    the rows between blocks and the collectives overlap the GEMMs."""
    image_tokens: Callable[[Any], int] | None = None
    """Generators whose transformer blocks run on slices of every image's tokens: cfg -> the token
    count per generated image the TP degree must divide (a DiT's patch tokens; a U-Net's tokens at its
    smallest attention level, of which every level's are multiples); None: the rows split otherwise
    (the LLM's ``data.seq_len``, an encoder's packed rows padded per microbatch)."""
    channels_last: bool = False
    """Convolutional families: on CUDA their weights and activations take the channels-last layout
    (``models/channels_last.py``), cuDNN's fast one, with ``cudnn.benchmark`` choosing kernels."""
    not_trainable: str = ""
    """Why recipes cannot train this family yet (empty when they can): its layers are built and
    tested, but some part of the pipeline around them is missing."""

    def run_layers(self, cfg: Any) -> int:
        """Transformer layers one forward of a module of this family runs (``blocks``)."""
        return self.blocks(cfg) if self.blocks is not None else cfg.layers

    def layers(self, cfg: Any, ctx: BuildContext) -> list[LayerDef]:
        """Ordered pipeline layers of a module of this family."""
        return importlib.import_module(self.model).layers(cfg, ctx)

    def hf_model(self, cfg: Any):
        """The whole Hugging Face / diffusers model (random init) whose keys ``hf_rules`` map: what
        ``disttrain-export`` fills and saves."""
        return importlib.import_module(self.model).hf_model(cfg)

    def tp_plan(self) -> Sequence[tuple[type, Any]]:
        """Which linears of which submodule classes tensor parallelism splits: (class, plan), the
        plan mapping a linear's submodule path to ``col`` | ``row`` | ``col_gather`` | ``col_pairs``
        (a column split that keeps a stacked (hidden, gate) projection's halves apart) and an int
        attribute to ``divide`` (a head count each TP rank holds 1/TP of), an embedding to ``vocab``
        (its rows split as a ``col_gather`` head's, when the vocabulary divides); a plan that depends on
        the instance is a function of the module returning that mapping."""
        return importlib.import_module(self.model).TP_PLAN
