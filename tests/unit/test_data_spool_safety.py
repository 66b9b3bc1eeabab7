"""The node-shared batch spool runs no code from its files and stays private to the user."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_producers import SHAPE
from test_data_spool import dead_pid

from disttrain_ds.data import spool
from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import ProducerError, build_source
from disttrain_ds.data.spool import SpoolBatch, SpoolError, SpoolWriter


class Payload:
    """Unpickling this creates ``marker``: proof that a file's code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def shares(tmp_path: Path, readers: int = 2) -> list[spool.NodeShare]:
    return spool.plan_shares([("h", os.getpid())] * readers, "safe", tmp_path)


def made(tmp_path: Path, readers: int = 2) -> list[spool.NodeShare]:
    """A created spool (as the leader makes it) and every rank's share of it."""
    out = shares(tmp_path, readers)
    spool.create(out[0])
    return out


def writer(share: spool.NodeShare) -> SpoolWriter:
    return SpoolWriter(share.directory, share.readers, 4, 0)


def batch(step: int = 0) -> SpoolBatch:
    samples = build_source(DataConfig(gen_images=[1, 2]), SHAPE, 3, 5).global_batch(step)
    samples[0].meta = {"source": "t", "records": [(0, 1), (0, 2)], "nested": {"x": [1.5, None, True]}}
    state = {"next": step + 1, "cursor": {"pos": 3, "skips": [["bad_json", 2]]}, "pair": (1, 2)}
    return SpoolBatch(step, samples, {"bad_json": 2}, {"image_decode_failed": 1}, state)


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg, msg
    return msg


def bits(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


# ----------------------------------------------------------------------------- format


def test_a_batch_reads_back_bit_identical_and_mapped_from_its_file(tmp_path):
    leader, reader = made(tmp_path)
    want = batch(0)
    assert writer(leader).put(want, lambda: True)
    got = spool.fetch(reader, 0, lambda: None)
    assert (got.step, got.plan, got.extra, got.state) == (want.step, want.plan, want.extra, want.state)
    assert isinstance(got.state["pair"], tuple)  # tuples stay tuples (the state goes into checkpoints)
    assert len(got.samples) == len(want.samples)
    for a, b in zip(got.samples, want.samples):
        assert type(a) is type(b)
        assert (a.sample_id, a.doc_lens, a.meta) == (b.sample_id, b.doc_lens, b.meta)
        for x, y in [(a.input_ids, b.input_ids), (a.labels, b.labels), (a.gen_targets[0], b.gen_targets[0]),
                     *zip(a.images, b.images, strict=True)]:
            assert bits(x) == bits(y)
    maps = Path("/proc/self/maps")
    if maps.exists():  # mapped, not read: a rank touches only the pages of the samples it uses
        assert str(spool._step_file(leader.directory, 0)) in maps.read_text()
    assert (leader.directory / "read_1").read_text() == "0"


def test_a_batch_holding_anything_but_tensors_and_plain_values_is_not_written(tmp_path):
    (leader,) = made(tmp_path, 1)
    bad = batch(0)
    bad.state["cursor"]["pos"] = np.int64(3)
    with pytest.raises(SpoolError) as err:
        writer(leader).put(bad, lambda: True)
    assert "batch['state']['cursor']['pos'] is a numpy.int64" in one_line(err.value)
    assert list(leader.directory.glob("step_*")) == []


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_planted_pickle_payload_is_refused_in_one_line_and_never_runs(tmp_path, how):
    leader, reader = made(tmp_path)
    marker = tmp_path / "payload_ran"
    path = spool._step_file(leader.directory, 0)
    content = {"format": spool.FORMAT, "step": 0, "samples": [Payload(marker)], "plan": {}, "extra": {}, "state": {}}
    if how == "torch.save":
        torch.save(content, path)
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(SpoolError) as err:
        spool.fetch(reader, 0, lambda: None)
    assert one_line(err.value).startswith(f"data.spool_dir: refused {path}: it ")
    assert not marker.exists()
    src = build_source(DataConfig(producers=1), SHAPE, 3, 5)  # a reading rank: no producers of its own
    src.share_with(reader)
    with pytest.raises(ProducerError) as err:
        src.global_batch(0)
    assert one_line(err.value).startswith(f"data.producers: data.spool_dir: refused {path}")
    assert not marker.exists()


def test_a_tensor_file_that_is_not_a_batch_is_refused_naming_the_file(tmp_path):
    leader, reader = made(tmp_path)
    path = spool._step_file(leader.directory, 0)
    torch.save({"step": 0, "samples": [torch.zeros(2)]}, path)
    with pytest.raises(SpoolError, match=rf"^data.spool_dir: refused {path}: not a {spool.FORMAT} file$"):
        spool.fetch(reader, 0, lambda: None)
    content = spool.encode_batch(batch(0))
    content["samples"][0] = {**content["samples"][0], "images": "not tensors"}
    torch.save(content, path)
    with pytest.raises(SpoolError, match=r"refused .*: sample field images is not a list of tensors$"):
        spool.fetch(reader, 0, lambda: None)


# ----------------------------------------------------------------------------- privacy


def test_spool_directory_is_0700_and_its_files_0600_under_umask_000(tmp_path):
    old = os.umask(0)
    try:
        leader, reader = made(tmp_path)
        w = writer(leader)
        w.put(batch(0), lambda: True)
        spool.fetch(reader, 0, lambda: None)
        w.error(0, 1, "ValueError: x", "Traceback")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(leader.directory).st_mode) == 0o700
    files = sorted(f.name for f in leader.directory.iterdir())
    assert files == ["error_0.json", "owner", "read_1", "step_000000000.pt"]
    assert {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in leader.directory.iterdir()} == dict.fromkeys(files, 0o600)


def check_refused(share: spool.NodeShare, what: str) -> None:
    """Every use of the spool (read, write, reset) is refused with one line naming it and ``what``."""
    expect = f"data.spool_dir: spool {share.directory} {what}; remove it or set data.spool_dir to another directory"
    for use in (lambda: spool.fetch(share, 0, lambda: None), lambda: writer(share).put(batch(0), lambda: True),
                lambda: spool.reset(share.directory)):
        with pytest.raises(SpoolError) as err:
            use()
        assert one_line(err.value) == expect


@pytest.mark.parametrize("mode,what", [(0o777, "is writable by other users (mode 0777)"),
                                       (0o720, "is writable by other users (mode 0720)"),
                                       (0o755, "is open to other users (mode 0755)")])
def test_a_spool_open_to_other_users_is_refused(tmp_path, mode, what):
    leader, reader = made(tmp_path)
    os.chmod(leader.directory, mode)
    check_refused(reader, what)
    check_refused(leader, what)
    assert list(leader.directory.glob("step_*")) == []


def test_a_spool_owned_by_another_user_is_refused_and_never_removed(tmp_path, monkeypatch):
    leader, reader = made(tmp_path)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)
    check_refused(reader, f"is owned by uid {me}, not by this user (uid {me + 1})")
    (leader.directory / "owner").write_text(f"{spool.host_key()} {dead_pid()}\n")  # a leader long gone
    assert spool.remove_stale(tmp_path) == []
    spool.remove(leader.directory)
    assert leader.directory.is_dir()
    monkeypatch.setattr(os, "getuid", lambda: me)
    assert spool.remove_stale(tmp_path) == [leader.directory]  # the same spool, once it is ours


def test_a_spool_path_that_is_a_symbolic_link_is_refused_and_its_target_kept(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (target / "owner").write_text(f"{spool.host_key()} {dead_pid()}\n")
    (target / "keep").write_text("keep")
    base = tmp_path / "base"
    base.mkdir()
    (leader,) = shares(base, 1)
    leader.directory.symlink_to(target)
    check_refused(leader, "is a symbolic link")
    assert spool.remove_stale(base) == []
    spool.remove(leader.directory)
    assert (target / "keep").exists() and leader.directory.is_symlink()
    with pytest.raises(SpoolError, match=r"^data.spool_dir: cannot create a batch spool in .*File exists"):
        spool.create(leader)


def test_a_base_directory_anyone_can_write_needs_the_sticky_bit(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    os.chmod(base, 0o777)
    (leader,) = shares(base, 1)
    with pytest.raises(SpoolError) as err:
        spool.create(leader)
    assert one_line(err.value) == (f"data.spool_dir: {base} is writable by other users without the sticky bit "
                                   "(mode 0777); set data.spool_dir to a private directory")
    assert not leader.directory.exists()
    os.chmod(base, 0o1777)  # as /dev/shm and /tmp
    spool.create(leader)
    assert stat.S_IMODE(os.stat(leader.directory).st_mode) == 0o700
