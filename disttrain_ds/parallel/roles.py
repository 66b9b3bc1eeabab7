"""What is module-specific about an engine: its data inputs, own loss and boundary tensors."""

from __future__ import annotations

import torch

from disttrain_ds.mllm.model import MicroBatch, MLLMSpec, gen_states, generator_states, llm_inputs
from disttrain_ds.models.objectives import diffusion_loss, lm_loss_sum

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
"""A last stage's outputs: one tensor, or a tuple (the LLM's logits and hidden states)."""


class Role:
    """Defaults: no upstream input, no own loss, no output sent downstream."""

    name = ""
    boundary_input_indices: tuple[int, ...] = ()  # positions of the upstream tensors in the first stage's input tuple

    def __init__(self, spec: MLLMSpec, module: str | None = None, sp=None):
        self.spec = spec
        self.module = module or spec.name_of(self.name)
        self.sp = sp  # this rank's SPContext (parallel/sequence_parallel.py), None without SP

    @property
    def boundary_input_index(self) -> int:
        """The one upstream tensor's position (modules with a single upstream)."""
        return self.boundary_input_indices[0]

    def first_inputs(self, mb: MicroBatch, received: list[torch.Tensor]) -> tuple:
        """The first stage's input tuple; ``received`` holds one tensor per upstream module."""
        raise NotImplementedError

    def own_loss(self, outputs: Outputs, mb: MicroBatch) -> torch.Tensor | None:
        """The module's own loss sum of the microbatch (None: it has none)."""
        return None

    def boundary_outputs(self, outputs: Outputs, mb: MicroBatch) -> list[torch.Tensor]:
        """One tensor per downstream module, in graph order (empty: nothing goes downstream)."""
        return []

    def rows_key(self, down: str) -> str:
        """``MicroBatch.sample_rows`` key of the tensor sent to downstream module ``down``."""
        raise NotImplementedError(f"{self.name} sends nothing downstream")

    def boundary_features(self, down: str) -> tuple[int, ...]:
        """Trailing dims of one row of the tensor sent to ``down`` (its rows vary per sample)."""
        raise NotImplementedError(f"{self.name} sends nothing downstream")


class EncoderRole(Role):
    name = "encoder"

    def rows_key(self, down: str) -> str:
        return f"{self.spec.modality(self.module)}_embeds"

    def first_inputs(self, mb: MicroBatch, received: list[torch.Tensor]) -> tuple:
        return mb.encoder_inputs(self.spec.modality(self.module))

    def boundary_outputs(self, outputs: Outputs, mb: MicroBatch) -> list[torch.Tensor]:
        return [outputs]

    def boundary_features(self, down: str) -> tuple[int, ...]:
        return (self.spec.llm.hidden_size,)  # one projected patch / audio frame embedding per row


class LLMRole(Role):
    """Each generator is sent the hidden states at its own query token's positions only."""

    name = "llm"

    @property
    def boundary_input_indices(self) -> tuple[int, ...]:
        return tuple(range(1, 1 + len(self.spec.encoders)))  # after input_ids, one per encoder

    def first_inputs(self, mb: MicroBatch, received: list[torch.Tensor]) -> tuple:
        if not received:  # no encoder: no placeholders to fill
            received = [torch.zeros(0, self.spec.llm.hidden_size, dtype=mb.pixels.dtype)]
        return llm_inputs(mb, received)

    def own_loss(self, outputs: Outputs, mb: MicroBatch) -> torch.Tensor | None:
        logits, _ = outputs
        if self.sp is None:
            return lm_loss_sum(logits, mb.labels, mb.lm_scale)
        # This rank's slice of the positions, times the SP factor DeepSpeed's DP x SP average takes back.
        return lm_loss_sum(logits, self.sp.shard(mb.labels), mb.lm_scale * self.sp.grad_factor)

    def boundary_outputs(self, outputs: Outputs, mb: MicroBatch) -> list[torch.Tensor]:
        _, hidden = outputs  # understanding only: no generator, nothing goes downstream
        if self.sp is not None and self.spec.generators:
            hidden = self.sp.gather(hidden)  # query positions lie on any slice: whole rows on every SP rank
        return gen_states(hidden, mb, self.spec)

    def rows_key(self, down: str) -> str:
        return self.spec.gen_rows_key(down)

    def boundary_features(self, down: str) -> tuple[int, ...]:
        return (self.spec.config(down).query_tokens, self.spec.llm.hidden_size)  # one image's queries per row


class GeneratorRole(Role):
    name = "generator"
    boundary_input_indices = (0,)

    def first_inputs(self, mb: MicroBatch, received: list[torch.Tensor]) -> tuple:
        g = mb.gens[self.module]
        return (generator_states(received[0], mb, self.module), g.noisy, g.timesteps)

    def own_loss(self, outputs: Outputs, mb: MicroBatch) -> torch.Tensor | None:
        g = mb.gens[self.module]
        return diffusion_loss(outputs, g.noise, g.weights)


ROLES = {"encoder": EncoderRole, "llm": LLMRole, "generator": GeneratorRole}
