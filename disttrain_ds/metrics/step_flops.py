"""FLOPs of one optimizer step of the MLLM, module by module, from the global batch's actual samples.

Every encoder's cost follows its own input items (an image's patches, a clip's frames: its family's
``item_size`` and ``item_flops``), the LLM's each packed sequence's document lengths, each
generator's the number of images it generates for the step (times its family's ``image_flops``),
so MFU reflects the data the step saw. The frozen VAE that encodes generation targets is counted
apart (``perf/vae_tflop``): it prepares data, and MFU's numerator holds model FLOPs only.
Frozen modules count forward only, or forward plus input gradient when a trainable module
upstream needs gradients through them.
"""

from __future__ import annotations

from disttrain_ds.cost.flop_count import vae_encode_flops
from disttrain_ds.cost.flops import llm_flops_packed, projector_flops_per_token, training_flops
from disttrain_ds.cost.mfu import StepFlops, tflops_per_gpu
from disttrain_ds.cost.peak import resolve_peak
from disttrain_ds.mllm.model import MLLMSpec
from disttrain_ds.samples import PackedSample


def flops_modes(spec: MLLMSpec) -> dict[str, str]:
    """train | frozen_passthrough | frozen for each module's own layers (key: its name) and for each
    projector (key: ``<name>/projector``), in data-flow order: each encoder then its projector, the
    LLM, each generator's projector then the generator."""
    modes: dict[str, str] = {}

    def chain(parts: list[tuple[str, bool]], upstream: bool) -> bool:
        """Modes along one path; whether anything on it (or upstream of it) trains."""
        for name, frozen in parts:
            modes[name] = "train" if not frozen else "frozen_passthrough" if upstream else "frozen"
            upstream = upstream or not frozen
        return upstream

    into_llm = False  # each encoder starts a path of its own
    for n in spec.encoders:
        cfg = spec.config(n)
        into_llm = chain([(n, cfg.frozen), (f"{n}/projector", cfg.projector.frozen)], False) or into_llm
    through_llm = chain([(spec.name_of("llm"), spec.llm.frozen)], into_llm)
    for n in spec.generators:  # each generator hangs off the LLM on its own
        cfg = spec.config(n)
        chain([(f"{n}/projector", cfg.projector.frozen), (n, cfg.frozen)], through_llm)
    return modes


class StepFlopsCounter:
    """Counts per-module FLOPs of a global batch for one model spec."""

    def __init__(self, spec: MLLMSpec):
        self.spec = spec
        self.modes = flops_modes(spec)
        # Every generated image costs the same in a generator's own layers: its family says how
        # much (a closed form, or one image counted once and cached).
        self._per_image = {n: spec.family(n).image_flops(spec.config(n), self.modes[n]) for n in spec.generators}
        self._vae_per_image: float | None = None

    def __call__(self, samples: list[PackedSample]) -> StepFlops:
        return StepFlops({n: self.module(n, samples) for n in self.spec.names})

    def module(self, name: str, samples: list[PackedSample]) -> float:
        """Training FLOPs of module ``name`` (its projector included) over ``samples``."""
        role = self.spec.roles[name]
        if role == "encoder":
            return self._encoder(name, samples)
        if role == "llm":
            return self._llm(samples)
        return self._generator(name, samples)

    def _encoder(self, name: str, samples: list[PackedSample]) -> float:
        cfg, fam, hidden = self.spec.config(name), self.spec.family(name), self.spec.llm.hidden_size
        sizes = [fam.item_size(cfg, t) for s in samples for t in s.inputs(fam.modality)]
        own = training_flops(sum(fam.item_flops(cfg, z) for z in sizes), mode=self.modes[name])
        rows = sum(fam.rows(cfg, z) for z in sizes)
        proj = projector_flops_per_token(in_dim=fam.width(cfg), hidden_dim=hidden, out_dim=hidden,
                                         mode=self.modes[f"{name}/projector"])
        return own + rows * proj

    def _llm(self, samples: list[PackedSample]) -> float:
        l, pad, mode = self.spec.llm, self.spec.special.pad, self.modes[self.spec.name_of("llm")]
        total = 0.0
        for s in samples:
            docs = [n for n in s.doc_lens if n > 0] or [int((s.input_ids != pad).sum()) or 1]
            total += llm_flops_packed(
                layers=l.layers, hidden=l.hidden_size, ffn_hidden=l.ffn_hidden, heads=l.heads,
                kv_heads=l.kv_heads, vocab=l.vocab_size, doc_lens=docs, head_dim=l.head_dim or None, mode=mode,
            )
        return total

    def _generator(self, name: str, samples: list[PackedSample]) -> float:
        cfg, fam, k = self.spec.config(name), self.spec.family(name), self.spec.gen_index(name)
        n = sum(int(t.shape[0]) for s in samples if (t := s.targets(k)) is not None)
        proj = projector_flops_per_token(in_dim=self.spec.llm.hidden_size, hidden_dim=fam.width(cfg),
                                         out_dim=fam.width(cfg), mode=self.modes[f"{name}/projector"])
        return n * (self._per_image[name] + cfg.query_tokens * proj)

    def vae(self, samples: list[PackedSample]) -> float:
        """FLOPs the first generator's frozen VAE spends encoding the step's generation targets (none
        without a VAE): work done for the data, not the model's, so MFU leaves it out."""
        g = self.spec.config(self.spec.generators[0]) if self.spec.generators else None
        vae = getattr(g, "vae", None)
        if vae is None or not vae.enabled:
            return 0.0
        if self._vae_per_image is None:
            self._vae_per_image = vae_encode_flops(vae, g.resolution * vae.downsample)
        return sum(int(t.shape[0]) for s in samples if (t := s.targets(0)) is not None) * self._vae_per_image


class MfuMeter:
    """``perf/mfu/*`` and ``perf/tflops_per_gpu/*`` of a step from its samples and duration."""

    def __init__(self, spec: MLLMSpec, gpus: dict[str, int], world: int, peak_override: float, device_name: str | None):
        self.count = StepFlopsCounter(spec)
        self.gpus, self.world = gpus, world
        self.peak, self.peak_source = resolve_peak(peak_override or None, device_name)

    def __call__(self, samples: list[PackedSample], step_seconds: float) -> dict[str, float]:
        spec = self.count.spec
        out = self.count(samples).metrics(gpus=self.gpus, peak_tflops=self.peak, step_seconds=step_seconds,
                                          world=self.world)
        vae = self.count.vae(samples)
        if vae:  # apart from MFU: where it runs (producer CPUs or generator GPUs) is a recipe choice
            out["perf/vae_tflop"] = vae / 1e12
            first = spec.generators[0]
            if spec.config(first).vae.placement == "generator":
                out["perf/tflops_per_gpu/vae"] = tflops_per_gpu(vae, self.gpus[first], step_seconds)
        return out
