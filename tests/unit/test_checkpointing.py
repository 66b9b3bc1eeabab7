"""Checkpoint bookkeeping without processes: completeness, pruning, resume choice, metrics rollback,
verification and fallback on step directories written by the checkpoint code."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from disttrain_ds.checkpoint import steps
from disttrain_ds.checkpoint.engine import SafeCheckpointEngine
from disttrain_ds.checkpoint.files import CheckpointFileError, file_entry
from disttrain_ds.checkpoint.steps import (
    FORMAT,
    MANIFEST,
    Checkpointer,
    checkpoint_root,
    complete_checkpoints,
    fingerprint,
    read_manifest,
    resolve_resume,
)
from disttrain_ds.errors import ConfigError
from disttrain_ds.metrics.rundir import reopen_run_dir
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]


def recipe(tmp: Path, *extra: str):
    return load_recipe(REPO / "recipes/tiny_cpu.yaml", ["layout=disaggregated", f"checkpoint.dir={tmp}", *extra])


def fake_checkpoint(root: Path, step: int, rec, world: int = 4, complete: bool = True, run_dir: Path | None = None) -> Path:
    d = root / (f"step_{step:08d}" + ("" if complete else ".partial"))
    d.mkdir(parents=True)
    man = {"format": FORMAT, "step": step, "fingerprint": fingerprint(rec, world), "files": {},
           "run_dir": str((run_dir or root).resolve())}
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
    Checkpointer(rec, engine=None, module="llm", rank=0, world=4, group=None)._prune(str(tmp_path))
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    assert (tmp_path / "step_00000004.partial").exists()  # not ours to judge


def test_keep_never_removes_another_runs_checkpoints(tmp_path):
    rec = recipe(tmp_path, "checkpoint.keep=1")
    fake_checkpoint(tmp_path, 1, rec, run_dir=tmp_path / "runs" / "other")
    for s in (2, 3):
        fake_checkpoint(tmp_path, s, rec, run_dir=tmp_path / "runs" / "mine")
    Checkpointer(rec, engine=None, module="llm", rank=0, world=4, group=None)._prune(str(tmp_path / "runs" / "mine"))
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 3]  # the other run's step 1 stays


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


# ---- real step directories written by the checkpoint code (four ranks played in turn) ----------
WORLD = 4


class RunsAShellCommand:
    """Unpickling this would create the marker file: the payload a crafted checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class FakeLayers(torch.nn.Module):
    """Stands in for a PipelineModule: one layer per rank, no parameters."""

    def __init__(self, rank: int):
        super().__init__()
        self._local_start, self._local_stop = rank, rank + 1


class FakeEngine:
    """Writes and reads DeepSpeed-like files through the safe checkpoint engine, as DeepSpeed does."""

    def __init__(self, rank: int):
        from disttrain_ds.checkpoint.engine import SafeCheckpointEngine

        self.rank, self.checkpoint_engine, self.optimizer, self.loaded = rank, SafeCheckpointEngine(), object(), {}
        self.module = FakeLayers(rank)

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        from deepspeed.runtime.zero.config import ZeroStageEnum

        d = Path(save_dir) / tag
        d.mkdir(exist_ok=True)
        torch.manual_seed(self.rank)
        self.checkpoint_engine.save({"weight": torch.randn(32, 32)}, str(d / f"layer_{self.rank:02d}-model_00-model_states.pt"))
        states = {"module": None, "optimizer": {"zero_stage": ZeroStageEnum.optimizer_states}, **client_state}
        self.checkpoint_engine.save(states, str(d / f"mp_rank_{self.rank:02d}_model_states.pt"))

    def load_checkpoint(self, load_dir, tag, **_):
        for f in sorted((Path(load_dir) / tag).iterdir()):  # DeepSpeed globs its tag folder
            self.loaded[f.name] = self.checkpoint_engine.load(str(f), map_location=lambda storage, loc: storage)
        return load_dir, {}


class FakeSource:
    def __init__(self, step: int = 0):
        self.state = {"next_step": step, "cursor": {"epoch": 0, "pos": 5 * step, "skips": [["too_long", 1]]}}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def rank_ckpt(rec, rank: int, log=None) -> Checkpointer:
    module = topology_of(rec).module_of(rank).name
    return Checkpointer(rec, FakeEngine(rank), module, rank, WORLD, None, log=log or (lambda line: None))


def real_checkpoint(rec, step: int) -> Path:
    final = checkpoint_root(rec) / f"step_{step:08d}"
    partial = final.with_name(final.name + ".partial")
    rank_ckpt(rec, 0).prepare(final, partial)
    reported, shards = {}, {}
    for r in range(WORLD):
        entries, record, failure = rank_ckpt(rec, r).write_share(partial, step, FakeSource(step))
        assert failure is None
        reported.update(entries)
        shards.setdefault(record.pop("module"), []).append(record)
    rank_ckpt(rec, 0).seal(partial, final, step, str(checkpoint_root(rec)), reported, shards)
    return final


def owner(rec, path: Path, name: str) -> int:
    """The one rank that checks ``name`` when resuming."""
    files = read_manifest(path)["files"]
    owners = [r for r in range(WORLD) if name in rank_ckpt(rec, r).my_files(files)]
    assert len(owners) == 1, owners
    return owners[0]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def rewrite_listed(step_dir: Path, name: str, write) -> None:
    """Replace a file and update its manifest entry: a crafted checkpoint whose checksums agree."""
    write(step_dir / name)
    man = json.loads((step_dir / MANIFEST).read_text())
    man["files"][name] = file_entry(step_dir / name)
    (step_dir / MANIFEST).write_text(json.dumps(man))


LAYER = "llm/layer_02-model_00-model_states.pt"


def test_saved_manifest_has_size_and_checksum_of_every_file_and_each_file_one_checker(tmp_path):
    rec = recipe(tmp_path)
    d = real_checkpoint(rec, 2)
    files = read_manifest(d)["files"]
    on_disk = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(files) == on_disk and all(files[n] == file_entry(d / n) for n in on_disk)
    assert "data.json" in files and "rng/rank00003.pt" in files and LAYER in files
    checked = [n for r in range(WORLD) for n in rank_ckpt(rec, r).my_files(files) if n != "data.json"]
    assert sorted(checked) == sorted(n for n in files if n != "data.json")  # each file once, data state by all


def test_every_rank_resumes_its_share(tmp_path):
    rec = recipe(tmp_path)
    d = real_checkpoint(rec, 2)
    for r in range(WORLD):
        ck, source = rank_ckpt(rec, r), FakeSource()
        assert ck.resume(d, source) == (d, read_manifest(d))
        assert source.state == FakeSource(2).state
        assert f"mp_rank_{r:02d}_model_states.pt" in ck.engine.loaded


def test_flipped_bytes_in_a_layer_file_are_named_and_an_explicit_resume_refuses(tmp_path):
    real_checkpoint(recipe(tmp_path), 2)
    d = real_checkpoint(recipe(tmp_path), 4)
    rec = recipe(tmp_path, f"train.resume={d}")
    flip_byte(d / LAYER)
    assert resolve_resume(rec, WORLD)[0] == d  # same size: only the checksum tells
    ck = rank_ckpt(rec, owner(rec, d, LAYER))
    with pytest.raises(ConfigError, match=f"{d} is damaged: {LAYER} does not match its sha256 checksum") as e:
        ck.resume(d, FakeSource())
    assert "\n" not in str(e.value) and d.is_dir() and not ck.engine.loaded  # nothing loaded, nothing moved


def test_auto_resume_sets_a_damaged_checkpoint_aside_and_falls_back_to_the_previous_one(tmp_path):
    rec = recipe(tmp_path)
    older = real_checkpoint(rec, 2)
    d = real_checkpoint(rec, 4)
    flip_byte(d / LAYER)
    lines = []
    path, manifest = resolve_resume(rec, WORLD)
    ck = rank_ckpt(rec, owner(rec, d, LAYER), log=lines.append)  # the rank that finds it; alone, it also renames
    source = FakeSource()
    assert ck.resume(path, source) == (older, read_manifest(older))
    assert source.state == FakeSource(2).state
    assert not d.exists() and (tmp_path / "step_00000004.damaged" / LAYER).is_file()
    fallback = [x for x in lines if "damaged" in x]
    assert len(fallback) == 1 and LAYER in fallback[0] and f"resuming from {older} (step 2)" in fallback[0]
    assert resolve_resume(rec, WORLD)[0] == older  # and the next run goes straight there


def test_load_without_fallback_sets_the_damaged_checkpoint_aside_for_the_next_run(tmp_path):
    rec = recipe(tmp_path)
    older = real_checkpoint(rec, 2)
    d = real_checkpoint(rec, 4)
    flip_byte(d / LAYER)
    ck = rank_ckpt(rec, owner(rec, d, LAYER))
    with pytest.raises(ConfigError, match="moved it to step_00000004.damaged; relaunch"):
        ck.load(d, FakeSource())
    assert resolve_resume(rec, WORLD)[0] == older


@pytest.mark.parametrize("damage", ["missing", "truncated", "not_json"])
def test_a_step_without_a_valid_manifest_is_skipped_by_auto_and_set_aside_by_the_next_save(tmp_path, damage):
    rec = recipe(tmp_path)
    older = real_checkpoint(rec, 2)
    d = real_checkpoint(rec, 4)
    man = d / MANIFEST
    {"missing": man.unlink, "truncated": lambda: man.write_text(man.read_text()[:50]),
     "not_json": lambda: man.write_bytes(b"\x80\x04K\x01.")}[damage]()
    lines = []
    assert resolve_resume(rec, WORLD, log=lines.append) == (older, read_manifest(older))
    assert len(lines) == 1 and str(d) in lines[0] and "not a complete checkpoint" in lines[0]
    # Training on from step 2 saves step 4 again: the leftover is renamed aside, nothing is deleted.
    ck = rank_ckpt(rec, 0, log=lines.append)
    ck.prepare(d, d.with_name(d.name + ".partial"))
    aside = tmp_path / "step_00000004.invalid"
    assert (aside / LAYER).is_file() and (d.with_name(d.name + ".partial") / "rng").is_dir() and not d.exists()
    assert "moved it to step_00000004.invalid" in lines[-1]


def test_a_file_of_the_wrong_size_is_skipped_by_auto_and_refused_explicitly(tmp_path):
    rec = recipe(tmp_path)
    older = real_checkpoint(rec, 2)
    d = real_checkpoint(rec, 4)
    (d / "rng/rank00001.pt").write_bytes(b"")
    lines = []
    assert resolve_resume(rec, WORLD, log=lines.append)[0] == older
    assert "rng/rank00001.pt is 0 bytes" in lines[0]
    with pytest.raises(ConfigError, match="is damaged: rng/rank00001.pt is 0 bytes, the manifest says"):
        resolve_resume(recipe(tmp_path, f"train.resume={d}"), WORLD)
    rank_ckpt(rec, 0).prepare(d, d.with_name(d.name + ".partial"))
    assert (tmp_path / "step_00000004.damaged").is_dir()


def test_auto_resume_with_only_damaged_checkpoints_is_an_error(tmp_path):
    rec = recipe(tmp_path)
    d = real_checkpoint(rec, 2)
    (d / LAYER).unlink()
    with pytest.raises(ConfigError, match="no checkpoint in .* is intact"):
        resolve_resume(rec, WORLD, log=lambda line: None)


def test_an_intact_checkpoint_is_never_set_aside_by_a_save(tmp_path):
    rec = recipe(tmp_path)
    d = real_checkpoint(rec, 2)
    with pytest.raises(ConfigError, match="already exists; it is never written over"):
        rank_ckpt(rec, 0).prepare(d, d.with_name(d.name + ".partial"))
    assert read_manifest(d) is not None


@pytest.mark.parametrize("name", ["rng/rank00001.pt", LAYER, "llm/mp_rank_02_model_states.pt"])
def test_a_pickle_payload_in_a_checkpoint_with_matching_checksums_never_runs(tmp_path, name):
    rec = recipe(tmp_path)
    d = real_checkpoint(rec, 2)
    marker = tmp_path / "marker"
    rewrite_listed(d, name, lambda p: torch.save({"weight": torch.ones(2), "x": RunsAShellCommand(marker)}, p))
    rank = 1 if name.startswith("rng/") else owner(rec, d, name)
    with pytest.raises(CheckpointFileError, match="is not a plain checkpoint") as e:
        rank_ckpt(rec, rank).resume(d, FakeSource())
    assert "\n" not in str(e.value) and name in str(e.value) and not marker.exists()


def test_a_pickle_in_place_of_the_data_state_never_runs(tmp_path):
    rec = recipe(tmp_path)
    d = real_checkpoint(rec, 2)
    marker = tmp_path / "marker"
    rewrite_listed(d, "data.json", lambda p: torch.save(RunsAShellCommand(marker), p))
    with pytest.raises(CheckpointFileError, match="data.json is not a plain checkpoint \\(not JSON"):
        rank_ckpt(rec, 3).resume(d, FakeSource())
    assert not marker.exists()


def test_a_file_the_manifest_does_not_list_in_a_module_folder_is_refused(tmp_path):
    rec = recipe(tmp_path)
    d = real_checkpoint(rec, 2)
    torch.save({"module": None}, d / "llm/mp_rank_07_model_states.pt")  # DeepSpeed would glob it up
    first_llm_rank = topology_of(rec).module("llm").ranks[0]
    with pytest.raises(ConfigError, match="llm/mp_rank_07_model_states.pt is not listed in the manifest"):
        rank_ckpt(rec, first_llm_rank).resume(d, FakeSource())


# ---- a write that fails: no space, quota, read-only ----------------------------------------------
# Every rank stops with one line that says where, how much room there is and what is safe to resume
# from; the half-written step goes, the intact checkpoints stay; a save that may not fit is announced.

def _disk_full(self, state_dict, path):
    raise OSError(errno.ENOSPC, "No space left on device", path)


def test_a_full_disk_during_a_save_stops_with_one_line_and_leaves_the_intact_checkpoint(tmp_path, monkeypatch):
    rec = recipe(tmp_path)
    intact = real_checkpoint(rec, 2)
    monkeypatch.setattr(TorchCheckpointEngine, "save", _disk_full)
    with pytest.raises(ConfigError) as err:
        rank_ckpt(rec, 0).save(4, FakeSource(4), str(tmp_path))
    msg = str(err.value)
    root = checkpoint_root(rec)
    assert "\n" not in msg and "could not write step_00000004" in msg and str(root) in msg, msg
    assert "No space left on device" in msg and "B free there" in msg, msg
    assert f"the newest intact checkpoint is {intact}" in msg and "resume: auto" in msg, msg
    assert not (root / "step_00000004.partial").exists() and not (root / "step_00000004").exists()
    assert [d for _, d in complete_checkpoints(root)] == [intact]


def test_a_failed_write_is_recorded_so_the_rank_keeps_step_with_the_others(tmp_path, monkeypatch):
    engine = SafeCheckpointEngine()
    monkeypatch.setattr(TorchCheckpointEngine, "save", lambda self, sd, path: (open(path, "wb").write(b"12"),
                                                                            _raise_zip_error())[1])
    engine.save({}, str(tmp_path / "a.pt"))  # no exception: DeepSpeed's barrier after it must still be reached
    engine.save({}, str(tmp_path / "b.pt"))  # nothing more is written once one write failed
    failure = engine.take_failure()
    assert failure is not None and "a.pt" in failure and "unexpected pos" in failure
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists() and engine.take_saved() == []
    assert engine.take_failure() is None


def _raise_zip_error():
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 388800 vs 388688")


def test_a_save_that_may_not_fit_is_announced_with_the_shortfall(tmp_path, monkeypatch):
    rec = recipe(tmp_path)
    real_checkpoint(rec, 2)
    said, real_usage = [], shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(steps.shutil, "disk_usage", lambda p: usage(10, 10, 1000))
    rank_ckpt(rec, 0, log=said.append).warn_if_short(4)
    assert len(said) == 1 and "short by" in said[0] and "step 4" in said[0], said
    # Negative control: with the room the file system really has, nothing is said.
    monkeypatch.setattr(steps.shutil, "disk_usage", real_usage)
    quiet = []
    rank_ckpt(rec, 0, log=quiet.append).warn_if_short(4)
    assert quiet == []
