"""FLOPs of one optimizer step of the MLLM, from the global batch's actual samples.

The image encoder's cost follows each image's patch count, an audio encoder's each clip's frame
count (its family's ``clip_flops``), the LLM's each packed sequence's document lengths, the generator's the number of images it generates (times its family's ``image_flops``),
so MFU reflects the data the step saw. The frozen VAE that encodes generation targets is counted
apart (``perf/vae_tflop``): it prepares data, and MFU's numerator holds model FLOPs only.
Frozen modules count forward only, or forward plus input gradient when a trainable module
upstream needs gradients through them.
"""

from __future__ import annotations

from disttrain_ds.cost.flops import (
    llm_flops_packed,
    projector_flops_per_token,
    training_flops,
    vae_encode_flops,
    vit_flops,
)
from disttrain_ds.cost.mfu import StepFlops, module_mfu, overall_mfu, tflops_per_gpu
from disttrain_ds.cost.peak import resolve_peak
from disttrain_ds.families import get_family
from disttrain_ds.mllm.model import MLLMSpec
from disttrain_ds.samples import PackedSample


def flops_modes(spec: MLLMSpec) -> dict[str, str]:
    """train | frozen_passthrough | frozen for each role's own layers (key: role) and for each
    projector (key: ``<role>/projector``), in data-flow order: encoder, its projector, LLM, the
    generator's projector, generator. Roles the graph lacks are absent."""
    e, g = spec.encoder, spec.generator
    chains = [[(n, spec.config(n).frozen), (f"{n}/projector", spec.config(n).projector.frozen)]
              for n in _audio_encoders(spec)]  # each encoder starts a path of its own
    if e is not None:
        chains.insert(0, [("encoder", e.frozen), ("encoder/projector", e.projector.frozen)])
    tail = [("llm", spec.llm.frozen)]
    if g is not None:
        tail += [("generator/projector", g.projector.frozen), ("generator", g.frozen)]
    modes, any_upstream = {}, False
    for parts in [*chains, tail]:
        trainable_upstream = any_upstream if parts is tail else False
        for name, frozen in parts:
            modes[name] = "train" if not frozen else "frozen_passthrough" if trainable_upstream else "frozen"
            trainable_upstream = trainable_upstream or not frozen
        any_upstream = any_upstream or trainable_upstream
    through_llm = not spec.llm.frozen or any(not frozen for parts in chains for _, frozen in parts)
    for n in _more_generators(spec):  # each further generator hangs off the LLM on its own
        upstream = through_llm
        for name, frozen in ((f"{n}/projector", spec.config(n).projector.frozen), (n, spec.config(n).frozen)):
            modes[name] = "train" if not frozen else "frozen_passthrough" if upstream else "frozen"
            upstream = upstream or not frozen
    return modes


def _more_generators(spec: MLLMSpec) -> tuple[str, ...]:
    """Generators past the first (whose figures are the ``generator`` role's)."""
    return spec.generators[1:]


def _audio_encoders(spec: MLLMSpec) -> tuple[str, ...]:
    return tuple(n for n in spec.encoders if spec.modality(n) == "audio")


def image_encoder_name(spec: MLLMSpec) -> str | None:
    """The module the ``encoder`` figures (``spec.encoder``, the image encoder) belong to."""
    return next((n for n in spec.encoders if spec.modality(n) == "image"), None)


class StepFlopsCounter:
    """Counts per-module FLOPs of a global batch for one model spec."""

    def __init__(self, spec: MLLMSpec):
        self.spec = spec
        self.modes = flops_modes(spec)
        g = spec.generator
        # Every generated image costs the same in the generator's own layers: its family says how
        # much (a closed form, or one image counted once and cached).
        self._gen_family = None if g is None else get_family(g.family, "generator")
        self._gen_per_image = 0.0 if g is None else self._gen_family.image_flops(g, self.modes["generator"])
        self._vae_per_image: float | None = None

    def __call__(self, samples: list[PackedSample]) -> StepFlops:
        e, l, g, sp = self.spec.encoder, self.spec.llm, self.spec.generator, self.spec
        p = e.patch_size if e is not None else 1
        patches = [(im.shape[1] // p) * (im.shape[2] // p) for s in samples for im in s.images]
        enc = 0.0
        if patches and e is not None:
            fam = get_family(e.family, "encoder")
            enc = vit_flops(
                layers=fam.run_layers(e), hidden=e.hidden_size, ffn_hidden=e.ffn_hidden, patches_per_image=patches,
                patch_size=p, include_cls=fam.cls_token, mode=self.modes["encoder"],
            )
            enc += sum(patches) * projector_flops_per_token(
                in_dim=e.hidden_size, hidden_dim=l.hidden_size, out_dim=l.hidden_size, mode=self.modes["encoder/projector"]
            )
        llm = 0.0
        for s in samples:
            docs = [n for n in s.doc_lens if n > 0] or [int((s.input_ids != sp.special.pad).sum()) or 1]
            llm += llm_flops_packed(
                layers=l.layers, hidden=l.hidden_size, ffn_hidden=l.ffn_hidden, heads=l.heads,
                kv_heads=l.kv_heads, vocab=l.vocab_size, doc_lens=docs, head_dim=l.head_dim or None,
                mode=self.modes["llm"],
            )
        n_gen = sum(int(s.gen_targets.shape[0]) for s in samples) if g is not None else 0
        gen = 0.0 if g is None else n_gen * (
            self._gen_per_image
            + g.query_tokens
            * projector_flops_per_token(
                in_dim=l.hidden_size, hidden_dim=self._gen_family.width(g), out_dim=self._gen_family.width(g),
                mode=self.modes["generator/projector"],
            )
        )
        return StepFlops(encoder=enc, llm=llm, generator=gen)

    def vae(self, samples: list[PackedSample]) -> float:
        """FLOPs the generator's frozen VAE spends encoding the step's generation targets (none
        without a VAE): work done for the data, not the model's, so MFU leaves it out."""
        g = self.spec.generator
        vae = getattr(g, "vae", None)
        if vae is None or not vae.enabled:
            return 0.0
        if self._vae_per_image is None:
            self._vae_per_image = vae_encode_flops(vae, g.resolution * vae.downsample)
        return sum(int(s.gen_targets.shape[0]) for s in samples) * self._vae_per_image

    def more_generators(self, samples: list[PackedSample]) -> dict[str, float]:
        """Training FLOPs of each generator past the first (its projector included) over the step's
        targets for it."""
        out, l = {}, self.spec.llm
        for name in _more_generators(self.spec):
            cfg, fam, k = self.spec.config(name), self.spec.family(name), self.spec.gen_index(name)
            n = sum(int(t.shape[0]) for s in samples if (t := s.targets(k)) is not None)
            proj = projector_flops_per_token(in_dim=l.hidden_size, hidden_dim=fam.width(cfg), out_dim=fam.width(cfg),
                                             mode=self.modes[f"{name}/projector"])
            out[name] = n * (fam.image_flops(cfg, self.modes[name]) + cfg.query_tokens * proj)
        return out

    def audio(self, samples: list[PackedSample]) -> dict[str, float]:
        """Training FLOPs of each audio encoder (its projector included) over the step's clips."""
        out, l = {}, self.spec.llm
        frames = [int(c.shape[1]) for s in samples for c in s.audio]
        for name in _audio_encoders(self.spec):
            cfg, fam = self.spec.config(name), self.spec.family(name)
            own = sum(fam.clip_flops(cfg, f) for f in frames)
            rows = sum(fam.rows(cfg, f) for f in frames) if frames else 0
            proj = projector_flops_per_token(in_dim=fam.width(cfg), hidden_dim=l.hidden_size, out_dim=l.hidden_size,
                                             mode=self.modes[f"{name}/projector"])
            out[name] = training_flops(own, mode=self.modes[name]) + rows * proj
        return out


class MfuMeter:
    """``perf/mfu/*`` and ``perf/tflops_per_gpu/*`` of a step from its samples and duration."""

    def __init__(self, spec: MLLMSpec, gpus: dict[str, int], world: int, peak_override: float, device_name: str | None):
        self.count = StepFlopsCounter(spec)
        self.gpus, self.world = gpus, world
        self.peak, self.peak_source = resolve_peak(peak_override or None, device_name)

    def __call__(self, samples: list[PackedSample], step_seconds: float) -> dict[str, float]:
        flops, spec = self.count(samples), self.count.spec
        names = {"encoder": image_encoder_name(spec), "llm": spec.name_of("llm"), "generator": spec.name_of("generator")}
        out = flops.metrics(
            **{f"{role}_gpus": self.gpus[n] if n else 0 for role, n in names.items()},
            peak_tflops=self.peak,
            step_seconds=step_seconds,
            world=self.world,
        )
        # Keys per module name (the three-module graph's names are its roles).
        renamed = {}
        for key, value in out.items():
            head, _, role = key.rpartition("/")
            renamed[f"{head}/{names.get(role) or role}"] = value
        audio = {**self.count.audio(samples), **self.count.more_generators(samples)}
        for name, f in audio.items():  # modules beside the three roles' figures
            renamed[f"perf/mfu/{name}"] = module_mfu(f, self.gpus[name], self.peak, step_seconds)
            renamed[f"perf/tflops_per_gpu/{name}"] = tflops_per_gpu(f, self.gpus[name], step_seconds)
        vae = self.count.vae(samples)
        if vae:  # apart from MFU: where it runs (producer CPUs or generator GPUs) is a recipe choice
            renamed["perf/vae_tflop"] = vae / 1e12
            g = spec.generator
            if g.vae.placement == "generator":
                renamed["perf/tflops_per_gpu/vae"] = tflops_per_gpu(vae, self.gpus[names["generator"]], step_seconds)
        if audio:
            total = flops.total + sum(audio.values())
            renamed["perf/mfu/overall"] = overall_mfu(total, self.world, self.peak, step_seconds)
            renamed["perf/tflops_per_gpu/overall"] = tflops_per_gpu(total, self.world, step_seconds)
        return renamed
