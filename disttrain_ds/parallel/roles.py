"""What is module-specific about an engine: its data inputs, own loss and boundary tensor."""

from __future__ import annotations

import torch

from ..models.mllm import MicroBatch, MLLMSpec, generator_states, llm_inputs, lm_loss_sum
from ..models.objectives import diffusion_loss, gen_condition


class Role:
    """Defaults: no upstream input, no own loss, no output sent downstream."""

    name = ""
    boundary_input_index: int = -1  # position of the upstream tensor in the first stage's input tuple
    rows_key: str = ""  # MicroBatch.sample_rows key of the tensor sent downstream

    def __init__(self, spec: MLLMSpec):
        self.spec = spec

    def first_inputs(self, mb: MicroBatch, received: torch.Tensor | None) -> tuple:
        raise NotImplementedError

    def own_loss(self, outputs, mb: MicroBatch) -> torch.Tensor | None:
        return None

    def boundary_output(self, outputs, mb: MicroBatch) -> torch.Tensor | None:
        return None

    def boundary_features(self) -> tuple[int, ...]:
        """Trailing dims of one row of ``boundary_output`` (its rows vary per sample)."""
        raise NotImplementedError(f"{self.name} sends nothing downstream")


class EncoderRole(Role):
    name = "encoder"
    rows_key = "image_embeds"

    def first_inputs(self, mb, received):
        return (mb.pixels, mb.image_hw)

    def boundary_output(self, outputs, mb):
        return outputs

    def boundary_features(self):
        return (self.spec.llm.hidden_size,)  # one projected patch embedding per row


class LLMRole(Role):
    name = "llm"
    boundary_input_index = 1
    rows_key = "gen_states"

    def first_inputs(self, mb, received):
        if received is None:  # no encoder: no image placeholders to fill
            received = torch.zeros(0, self.spec.llm.hidden_size, dtype=mb.pixels.dtype)
        return llm_inputs(mb, received)

    def own_loss(self, outputs, mb):
        logits, _ = outputs
        return lm_loss_sum(logits, mb.labels, mb.lm_scale)

    def boundary_output(self, outputs, mb):
        if self.spec.generator is None:  # understanding only: nothing goes downstream
            return None
        _, hidden = outputs
        return gen_condition(hidden, mb.gen_mask, self.spec.generator.query_tokens)

    def boundary_features(self):
        return (self.spec.generator.query_tokens, self.spec.llm.hidden_size)  # one image's queries per row


class GeneratorRole(Role):
    name = "generator"
    boundary_input_index = 0

    def first_inputs(self, mb, received):
        return (generator_states(received, mb), mb.noisy, mb.timesteps)

    def own_loss(self, outputs, mb):
        return diffusion_loss(outputs, mb.noise, mb.gen_weights)


ROLES = {"encoder": EncoderRole, "llm": LLMRole, "generator": GeneratorRole}
