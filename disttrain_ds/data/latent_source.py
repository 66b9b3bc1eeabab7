"""Latent generation targets made where the data is prepared: a source's RGB targets encoded by the
generator's frozen VAE (``vae.placement: producer``), so batches carry latents instead of pixels."""

from __future__ import annotations

from dataclasses import replace

from disttrain_ds.data.source import SampleSource
from disttrain_ds.models.vae import LatentEncoder
from disttrain_ds.samples import PackedSample


class LatentSource(SampleSource):
    """``inner``'s batches with each sample's first generator's targets replaced by their VAE latents. The VAE
    is built on first use, in the process that prepares batches (a producer, or the trainer)."""

    def __init__(self, inner: SampleSource, vae_cfg, seed: int):
        self.inner, self.vae_cfg, self.seed = inner, vae_cfg, seed
        self.special, self.base_vocab = inner.special, inner.base_vocab
        self._encoder = None

    @property
    def encoder(self):
        if self._encoder is None:
            self._encoder = LatentEncoder(self.vae_cfg, self.seed)
        return self._encoder

    def encode(self, s: PackedSample) -> PackedSample:
        if not s.gen_targets:
            return s
        return replace(s, gen_targets=[self.encoder(s.gen_targets[0]), *s.gen_targets[1:]])

    def global_batch(self, step: int) -> list[PackedSample]:
        return [self.encode(s) for s in self.inner.global_batch(step)]

    def describe(self) -> str:
        r = self.vae_cfg.resolved()
        what = self.vae_cfg.checkpoint or f"preset {self.vae_cfg.preset}"
        return f"{self.inner.describe()}, targets encoded to {r.latent_channels}-channel latents by the VAE ({what})"

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def skip_counts(self) -> dict[str, int]:
        return self.inner.skip_counts()

    def step_skips(self, step: int) -> tuple[dict[str, int], dict[str, int]]:
        return self.inner.step_skips(step)

    def close(self) -> None:
        self.inner.close()
