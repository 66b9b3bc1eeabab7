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
from disttrain_ds.data.fingerprint import data_fingerprint, known_fingerprints
from disttrain_ds.data.split import TRAIN
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
    from disttrain_ds.data.fingerprint import shape_facts

    facts = [src.fmt, str(src.path), len(src.table), src.seed, src.batch, asdict(src.cfg), shape_facts(src.shape, False)]
    for drop in ("producers", "queue_depth", "reorder", "cache_dir", *src._unused_keys, "read", "max_seq_len"):  # later
        facts[5].pop(drop, None)
    for drop in ("dp_size", "micro_batch", "vae", "more_gens", "columns", "gen_name"):  # all but the first two: later
        facts[6].pop(drop, None)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_a_record_sources_data_state_from_before_the_vae_still_loads(tmp_path):
    from PIL import Image

    from disttrain_ds.data.config import DataConfig
    from disttrain_ds.data.registry import open_source, resolve
    from disttrain_ds.samples import GenShape, ShapeSpec

    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 30), (255, 0, 0)).save(tmp_path / "images" / "red.png")
    (tmp_path / "a.jsonl").write_text(json.dumps({"image": "images/red.png", "caption": "Red.", "generate": True}) + "\n")
    cfg = DataConfig(source="local", path=str(tmp_path), seq_len=64, image_sizes=[16], shuffle=False)
    src = open_source(resolve(cfg), ShapeSpec(patch_size=8, gens=(GenShape(16, 3, 4),)), 2, 0)
    src.global_batch(0)
    state = src.state_dict()
    assert state["fingerprint"] == _pre_vae_data_fingerprint(src)
    later = data_fingerprint(*src._setup(), later_keys=True)
    src.load_state_dict({**state, "fingerprint": later})  # as the VAE's versions wrote it
    with pytest.raises(ValueError, match="different data setup"):  # negative control
        src.load_state_dict({**state, "fingerprint": "0" * 16})


# Data-state fingerprints an earlier version (one cost model shared by the image encoder, the first
# generator and the audio encoder; the first generator's shape in fields of its own) wrote for a
# local record source at /data/records of 5 records, read with each recipe's own model shape.
WRITTEN_BEFORE = {"tiny_cpu": "e9b148dc4aa7e30c", "tiny_two_gen": "fef4e3690766e48f", "tiny_omni": "b39df5f07a6603cf",
                  "tiny_vlm": "ea6413d6090d849d", "tiny_cpu_latent": "671fb2b17dc8db54"}


def _known(name: str, *overrides: str) -> set[str]:
    from disttrain_ds.runtime.setup import shape_spec

    r = load_recipe(name, list(overrides))
    head = ["local", "/data/records", 5, r.seed, r.train.global_batch]
    return known_fingerprints(head, asdict(r.data), shape_spec(r), TRAIN, ("fields", "shard_parts"))


@pytest.mark.parametrize("name", sorted(WRITTEN_BEFORE))
def test_a_data_state_written_before_per_module_cost_terms_still_loads(name):
    known = _known(name)
    assert WRITTEN_BEFORE[name] in known
    assert not known & (set(WRITTEN_BEFORE.values()) - {WRITTEN_BEFORE[name]})  # negative control: no other recipe's


def test_the_earlier_layout_is_rebuilt_exactly_not_matched_loosely():
    # Those states hashed the cost model: the same data under another LLM depth hashed differently,
    # and is not taken for the recipe's own state.
    assert WRITTEN_BEFORE["tiny_cpu"] not in _known("tiny_cpu", "model.llm.layers=3")
    # This version's fingerprint leaves the cost model out: it only orders each batch.
    assert _known("tiny_cpu") & _known("tiny_cpu", "model.llm.layers=3")
