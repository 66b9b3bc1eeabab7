"""Checkpoint bookkeeping without processes: completeness, pruning, resume choice, metrics rollback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain_ds.config import load_recipe
from disttrain_ds.configtools import ConfigError
from disttrain_ds.runtime.checkpointing import (
    FORMAT,
    MANIFEST,
    Checkpointer,
    complete_checkpoints,
    fingerprint,
    resolve_resume,
)
from disttrain_ds.runtime.rundir import reopen_run_dir

REPO = Path(__file__).resolve().parents[2]


def recipe(tmp: Path, *extra: str):
    return load_recipe(REPO / "recipes/tiny_cpu.yaml", ["layout=disaggregated", f"checkpoint.dir={tmp}", *extra])


def fake_checkpoint(root: Path, step: int, rec, world: int = 4, complete: bool = True) -> Path:
    d = root / (f"step_{step:08d}" + ("" if complete else ".partial"))
    d.mkdir(parents=True)
    man = {"format": FORMAT, "step": step, "fingerprint": fingerprint(rec, world), "files": [], "run_dir": str(root)}
    (d / MANIFEST).write_text(json.dumps(man))
    return d


def test_only_renamed_directories_with_a_matching_manifest_count_as_complete(tmp_path):
    rec = recipe(tmp_path)
    fake_checkpoint(tmp_path, 2, rec)
    fake_checkpoint(tmp_path, 4, rec, complete=False)  # crash during save
    bad = tmp_path / "step_00000006"
    bad.mkdir()
    (bad / MANIFEST).write_text("{not json")
    wrong = tmp_path / "step_00000008"
    wrong.mkdir()
    (wrong / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": 7}))  # step disagrees with name
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]


def test_resume_auto_picks_the_newest_complete_checkpoint(tmp_path):
    rec = recipe(tmp_path)
    fake_checkpoint(tmp_path, 2, rec)
    newest = fake_checkpoint(tmp_path, 4, rec)
    fake_checkpoint(tmp_path, 6, rec, complete=False)
    path, man = resolve_resume(rec, 4)
    assert path == newest and man["step"] == 4


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path):
    assert resolve_resume(recipe(tmp_path / "none"), 4) == (None, None)


def test_resume_none_refuses_to_write_into_a_directory_with_checkpoints(tmp_path):
    rec = recipe(tmp_path, "train.resume=none", "checkpoint.every=2")
    fake_checkpoint(tmp_path, 2, rec)
    with pytest.raises(ConfigError, match="already holds checkpoints.*train.resume=auto"):
        resolve_resume(rec, 4)


def test_resume_refuses_a_different_world_or_model_naming_the_field(tmp_path):
    fake_checkpoint(tmp_path, 2, recipe(tmp_path))
    with pytest.raises(ConfigError, match=r"world_size \(checkpoint: 4, this run: 5\)"):
        resolve_resume(recipe(tmp_path), 5)
    with pytest.raises(ConfigError, match=r"model.llm.layers"):
        resolve_resume(recipe(tmp_path, "model.llm.layers=3"), 4)


def test_resume_from_a_path_without_manifest_is_a_one_line_error(tmp_path):
    d = tmp_path / "step_00000002"
    d.mkdir()
    with pytest.raises(ConfigError, match="is not a complete checkpoint") as e:
        resolve_resume(recipe(tmp_path, f"train.resume={d}"), 4)
    assert "\n" not in str(e.value)


def test_resume_refuses_when_later_checkpoints_would_be_written_over(tmp_path):
    rec = recipe(tmp_path, "checkpoint.every=2")
    first = fake_checkpoint(tmp_path, 2, rec)
    fake_checkpoint(tmp_path, 4, rec)
    with pytest.raises(ConfigError, match="later checkpoints"):
        resolve_resume(recipe(tmp_path, "checkpoint.every=2", f"train.resume={first}"), 4)


def test_keep_removes_oldest_complete_checkpoints_only(tmp_path):
    rec = recipe(tmp_path, "checkpoint.keep=2")
    for s in (1, 2, 3):
        fake_checkpoint(tmp_path, s, rec)
    fake_checkpoint(tmp_path, 4, rec, complete=False)
    Checkpointer(rec, engine=None, module="llm", rank=0, world=4, group=None)._prune()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    assert (tmp_path / "step_00000004.partial").exists()  # not ours to judge


def test_checkpoints_are_due_every_n_steps_and_after_the_last(tmp_path):
    c = Checkpointer(recipe(tmp_path, "checkpoint.every=3", "train.steps=7"), None, "llm", 0, 4, None)
    assert [s for s in range(1, 8) if c.due(s)] == [3, 6, 7]
    off = Checkpointer(recipe(tmp_path, "train.steps=7"), None, "llm", 0, 4, None)
    assert not any(off.due(s) for s in range(1, 8))


def test_reopened_run_dir_keeps_steps_up_to_the_checkpoint_and_moves_the_rest_aside(tmp_path):
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in range(1, 6)] + ['{"step": 6, "lo']  # cut by the kill
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    path, moved = reopen_run_dir(tmp_path, 3)
    assert path == tmp_path and moved == 3
    kept = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [1, 2, 3]
    aside = (tmp_path / "metrics.rolled_back.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in aside[:2]] == [4, 5] and aside[2] == '{"step": 6, "lo'


def test_reference_layout_refuses_checkpoint_every(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.every"):
        load_recipe(REPO / "recipes/tiny_cpu.yaml", ["checkpoint.every=2"])
