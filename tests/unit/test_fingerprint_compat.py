"""Checkpoints written before later recipe fields existed still resume: a disabled VAE, the LLM's
attention path and the VAE's encode batch add nothing to what a resume compares, nor do later data
fields at their defaults; a real change (a VAE turned on, another shape) is still refused."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from disttrain_ds.checkpoint.manifest import FORMAT, MANIFEST, fingerprint, resolve_resume, step_dir_name
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.schema import load_recipe


def _written_before_vae(fp: dict, audio_keys: bool = True) -> dict:
    """The fingerprint as versions before the VAE, ``doc_attention`` and ``data.read`` wrote it
    (``audio_keys``: and before the audio data fields)."""
    old = copy.deepcopy(fp)
    model = old["model"]
    for m in [*(v for k, v in model.items() if k != "modules"), *model.get("modules", {}).values()]:
        if isinstance(m, dict):
            m.pop("vae", None)
            m.pop("doc_attention", None)
    old["data"].pop("read")
    if audio_keys:
        for key in ("max_audio", "audio_frames"):
            old["data"].pop(key)
        for key in ("audio", "audios"):
            old["data"]["fields"].pop(key)
    return old


def _checkpoint(root: Path, fp: dict, step: int = 1) -> Path:
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": {}, "fingerprint": fp,
                                             "run_dir": str(root), "shards": {}}))
    return path


def _resume(name: str, path: Path, *overrides: str):
    r = load_recipe(name, [f"train.resume={path}", f"checkpoint.dir={path.parent}", "checkpoint.every=0", *overrides])
    return resolve_resume(r, 4, log=lambda _: None)


# Three-module form without audio; model.modules with audio (its data fields are set) and a painter.
@pytest.mark.parametrize("name,audio_keys", [("tiny_cpu", True), ("tiny_omni", False)])
def test_a_checkpoint_from_before_the_vae_and_doc_attention_resumes(tmp_path, name, audio_keys):
    fp = fingerprint(load_recipe(name), 4)
    old = _written_before_vae(fp, audio_keys)
    assert old != fp and "vae" not in json.dumps(old["model"]) and "doc_attention" not in json.dumps(old)
    path = _checkpoint(tmp_path, old)
    assert _resume(name, path)[0] == path
    # The attention path does not change the math: changing it resumes too.
    llm = "llm" if name == "tiny_cpu" else "modules.llm"
    assert _resume(name, path, f"model.{llm}.doc_attention=spans")[0] == path
    assert _resume(name, path, "data.read=all")[0] == path  # nor does which host reads which samples


def test_a_checkpoint_with_the_vae_section_written_out_resumes_with_another_encode_batch(tmp_path):
    fp = fingerprint(load_recipe("tiny_cpu_latent"), 4)
    fp["model"]["generator"]["vae"].pop("batch")  # as written before vae.batch existed
    path = _checkpoint(tmp_path, fp)
    assert _resume("tiny_cpu_latent", path, "model.generator.vae.batch=4")[0] == path


def test_a_vae_turned_on_or_another_vae_is_still_refused_on_resume(tmp_path):
    """Negative controls: what changes the latents is a different setup."""
    old = _written_before_vae(fingerprint(load_recipe("tiny_cpu"), 4))
    path = _checkpoint(tmp_path / "a", old)
    with pytest.raises(ConfigError, match=r"model\.generator\.vae"):
        _resume("tiny_cpu", path, "model.generator.vae.preset=tiny", "model.generator.in_channels=4",
                "model.generator.resolution=8")
    with pytest.raises(ConfigError, match=r"data\.max_audio"):
        _resume("tiny_cpu", path, "data.max_audio=2")
    latent = _checkpoint(tmp_path / "b", fingerprint(load_recipe("tiny_cpu_latent"), 4))
    with pytest.raises(ConfigError, match=r"model\.generator\.vae\.scaling_factor"):
        _resume("tiny_cpu_latent", latent, "model.generator.vae.scaling_factor=0.7")


def _pre_vae_data_fingerprint(src) -> str:
    """``RecordSource._fingerprint`` as written before ``ShapeSpec`` had ``vae`` and ``more_gens``."""
    facts = [src.fmt, str(src.path), len(src.table), src.seed, src.batch, asdict(src.cfg), asdict(src.shape)]
    for drop in ("producers", "queue_depth", "reorder", "cache_dir", *src._unused_keys, "read"):  # read: later
        facts[5].pop(drop, None)
    for drop in ("dp_size", "micro_batch", "vae", "more_gens", "columns", "gen_name"):  # all but the first two: later
        facts[6].pop(drop, None)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_a_record_sources_data_state_from_before_the_vae_still_loads(tmp_path):
    from PIL import Image

    from disttrain_ds.data.config import DataConfig
    from disttrain_ds.data.registry import open_source, resolve
    from disttrain_ds.samples import ShapeSpec

    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 30), (255, 0, 0)).save(tmp_path / "images" / "red.png")
    (tmp_path / "a.jsonl").write_text(json.dumps({"image": "images/red.png", "caption": "Red.", "generate": True}) + "\n")
    cfg = DataConfig(source="local", path=str(tmp_path), seq_len=64, image_sizes=[16], shuffle=False)
    src = open_source(resolve(cfg), ShapeSpec(patch_size=8, gen_resolution=16, gen_channels=3, query_tokens=4), 2, 0)
    src.global_batch(0)
    state = src.state_dict()
    assert state["fingerprint"] == _pre_vae_data_fingerprint(src)
    src.load_state_dict({**state, "fingerprint": src._fingerprint(later_keys=True)})  # as the VAE's versions wrote it
    with pytest.raises(ValueError, match="different data setup"):  # negative control
        src.load_state_dict({**state, "fingerprint": "0" * 16})
