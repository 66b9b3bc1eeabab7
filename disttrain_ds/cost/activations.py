"""Bytes autograd keeps for backward: the types every family's activation formula speaks.

A family's ``activation_layers`` (in its folder) maps its config and the worst-case sample to a
``LayerBytes`` per pipeline layer; ``estimate/activations.py`` picks the formula for each module of a
recipe. The counts follow what the layers save (checked against saved-tensor hooks on real layers in
``tests/unit/test_memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    sliced: list[float] = field(default_factory=list)
    """Under tensor parallelism on sequence slices (``parallel.<module>.tp_overlap``): the part of
    each layer's ``saved`` beyond ``sharded`` that every TP rank then keeps for its slice only (the
    norms' inputs and statistics; the column-parallel GEMMs keep their gathered whole-row inputs,
    as the replicated layout keeps them). Empty: the family's formula counts no such part (the
    replicated figure, an upper bound)."""
    sliced_outputs: list[float] = field(default_factory=list)
    """The part of each layer's ``outputs`` that is this rank's slice under that layout (the rows
    the embedding and the blocks pass on; a generator's whole condition and modulation beside
    them are not; the head joins the slices again). Empty: none."""

    def on_rank(self, tp: int, sliced: bool = False) -> list[float]:
        """Each layer's saved bytes on one of ``tp`` TP ranks (``sliced``: activations on sequence
        slices between the layers)."""
        split = self.sharded or [0.0] * len(self.saved)
        seq = self.sliced if sliced and self.sliced else [0.0] * len(self.saved)
        return [s - x + x / tp - (y - y / tp) for s, x, y in zip(self.saved, split, seq)]

    def outputs_on_rank(self, tp: int, sliced: bool = False) -> list[float]:
        """Each layer's output bytes on one of ``tp`` TP ranks."""
        cut = self.sliced_outputs if sliced and self.sliced_outputs else [0.0] * len(self.outputs)
        return [o - c + c / tp for o, c in zip(self.outputs, cut)]
