"""Early, one-line stops: a loss that is not finite, unwritable output directories, too little disk
for a checkpoint, YAML alias bombs; and end-of-run files that never replace earlier ones."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_health import FakeStore, dog  # noqa: E402 - tests/unit is on sys.path under pytest

from disttrain_ds.configtools import load_yaml
from disttrain_ds.errors import ConfigError, TrainingDiverged
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime import guards, health
from disttrain_ds.runtime.guards import check_finite_loss, check_output_dirs, fresh_path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_nonfinite_loss_names_the_step_and_continue_trains_on():
    with pytest.raises(TrainingDiverged) as exc:
        check_finite_loss({"loss": math.nan, "loss/lm": 1.0, "loss/gen": math.nan}, 7)
    msg = _one_line(exc)
    assert "not finite at step 7" in msg and "loss nan" in msg and "loss/lm" not in msg
    check_finite_loss({"loss": math.inf}, 7, "continue")
    check_finite_loss({"loss": 1.5, "loss/lm": 1.0, "loss/gen": 0.5}, 7)


def test_reference_trainer_stops_on_a_diverged_loss():
    from disttrain_ds.runtime.reference import train_reference

    recipe = load_recipe(TINY, ["layout=reference", "optim.lr=1.0e+30", "train.steps=6"])
    with pytest.raises(TrainingDiverged) as exc:
        train_reference(recipe, None, log=None)
    step = int(_one_line(exc).split("at step ")[1].split()[0])
    assert 1 <= step <= 6


def test_on_nonfinite_is_checked():
    assert load_recipe(TINY).train.on_nonfinite == "stop"
    with pytest.raises(ConfigError, match="'train.on_nonfinite' must be one of stop | continue"):
        load_recipe(TINY, ["train.on_nonfinite=skip"])


def test_watchdog_ends_every_rank_with_exit_1_and_blames_no_peer(monkeypatch):
    monkeypatch.setattr(health, "DIVERGED_QUIET_S", 0.0)
    store = FakeStore()
    lines, codes = [], []
    exc = TrainingDiverged("loss is not finite at step 3 (loss nan)")
    dog(store, rank=1, emit=lines.append, exit_fn=codes.append, interval_s=0.01).handle(exc, 1.0)
    dog(store, rank=0, emit=lines.append, exit_fn=codes.append, interval_s=0.01).handle(exc, 1.0)
    assert codes == [health.EXIT_FAILED, health.EXIT_FAILED]
    assert lines == ["error: loss is not finite at step 3 (loss nan)"]  # rank 0 only, no "because rank 1"


def _recipe(tmp_path: Path, *overrides: str):
    return load_recipe(TINY, [f"logging.dir={tmp_path / 'run'}", *overrides])


def test_unwritable_logging_dir_is_refused_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("x")
    blocked = tmp_path / "file" / "sub"  # under a regular file: nobody, root included, can create it
    with pytest.raises(ConfigError) as exc:
        check_output_dirs(load_recipe(TINY, [f"logging.dir={blocked}"]))
    msg = _one_line(exc)
    assert "'logging.dir'" in msg and str(blocked) in msg and "not a directory" in msg


def test_read_only_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if _writable(ro):
            pytest.skip("permissions are not enforced here (running as root)")
        with pytest.raises(ConfigError) as exc:
            check_output_dirs(load_recipe(TINY, [f"logging.dir={ro / 'run'}"]))
        assert "'logging.dir'" in _one_line(exc) and "not writable" in str(exc.value)
    finally:
        ro.chmod(0o700)


def _writable(d: Path) -> bool:
    try:
        (d / "probe").touch()
    except OSError:
        return False
    (d / "probe").unlink()
    return True


def test_checkpoint_dir_checked_only_when_checkpoints_are_on(tmp_path):
    (tmp_path / "file").write_text("x")
    blocked = tmp_path / "file" / "ckpt"
    off = _recipe(tmp_path, "layout=disaggregated", f"checkpoint.dir={blocked}", "checkpoint.every=0")
    check_output_dirs(off, rows=[])
    on = _recipe(tmp_path, "layout=disaggregated", f"checkpoint.dir={blocked}", "checkpoint.every=2")
    with pytest.raises(ConfigError) as exc:
        check_output_dirs(on, rows=[])
    assert "'checkpoint.dir'" in _one_line(exc) and str(blocked) in str(exc.value)
    assert not (tmp_path / "run").exists()  # nothing is created by the check


def test_too_little_disk_for_one_checkpoint_is_refused(tmp_path, monkeypatch):
    from disttrain_ds.estimate.memory import estimate

    recipe = _recipe(tmp_path, "layout=disaggregated", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2")
    rows = estimate(recipe)
    need = guards.checkpoint_bytes(recipe, rows)
    assert need > sum(r.weights for r in rows)  # weights and AdamW states
    check_output_dirs(recipe, rows)

    class Usage:
        free = int(need) - 1

    monkeypatch.setattr(guards.shutil, "disk_usage", lambda _: Usage)
    with pytest.raises(ConfigError) as exc:
        check_output_dirs(recipe, rows)
    assert "'checkpoint.dir'" in _one_line(exc) and "GiB free" in str(exc.value)


def test_fresh_path_never_picks_an_existing_file(tmp_path):
    p = tmp_path / "trace" / "rank0.json"
    assert fresh_path(p) == p
    p.parent.mkdir()
    p.write_text("first")
    assert fresh_path(p) == p.with_name("rank0-2.json")
    p.with_name("rank0-2.json").write_text("second")
    assert fresh_path(p) == p.with_name("rank0-3.json")
    assert p.read_text() == "first"


def test_yaml_alias_bomb_is_refused_fast(tmp_path):
    lines = ["name: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"k{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]  # 9^10 nodes
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as exc:  # refused before the aliases expand (9^10 nodes would never end)
        load_recipe(bomb)
    msg = _one_line(exc)
    assert str(bomb) in msg and "aliases expand to more than" in msg


def test_yaml_with_a_few_aliases_still_loads(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("a: &x [1, 2]\nb: *x\nc: {<<: {d: 1}}\n")
    assert load_yaml(p) == {"a": [1, 2], "b": [1, 2], "c": {"d": 1}}
