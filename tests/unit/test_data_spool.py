"""Node-shared preprocessing: one host's producers write each batch once; every rank reads it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_data_producers import SHAPE, mmc4, same

from disttrain_ds.data import spool
from disttrain_ds.data.config import DataConfig
from disttrain_ds.data.producers import ProducerError, build_source


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def node(tmp_path: Path, cfg: DataConfig, readers: int, batch: int = 4, seed: int = 11, leader_pid: int | None = None):
    """``readers`` sources sharing one spool, as ranks 0..readers-1 of one host."""
    hosts = [("host-a", leader_pid or os.getpid())] * readers
    shares = spool.plan_shares(hosts, "t0", tmp_path)
    sources = [build_source(cfg, SHAPE, batch, seed) for _ in range(readers)]
    for src, share in zip(sources, shares):
        src.share_with(share)
    return sources, shares[0].directory


def step_files(directory: Path) -> list[int]:
    return sorted(int(f.stem[5:]) for f in directory.glob("step_*.pt"))


def test_plan_shares_groups_ranks_by_host_with_the_lowest_rank_leading(tmp_path):
    hosts = [("a", 10), ("b", 20), ("a", 11), ("b", 21)]
    shares = spool.plan_shares(hosts, "xyz", tmp_path)
    assert [s.readers for s in shares] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [s.leader for s in shares] == [True, True, False, False]
    assert [s.leader_pid for s in shares] == [10, 20, 10, 20]
    assert {s.directory for s in shares} == {tmp_path / "disttrain-spool-xyz"}  # one per host's own disk


def test_every_rank_of_a_host_reads_the_in_process_batches_from_one_producer(tmp_path, fixtures_dir):
    cfg = mmc4(fixtures_dir)
    local = build_source(cfg, SHAPE, 4, 11)
    want = [local.global_batch(s) for s in range(4)]
    (leader, reader), directory = node(tmp_path, dataclasses.replace(cfg, producers=1, queue_depth=2), 2)
    try:
        for step in range(4):
            assert same(leader.global_batch(step), want[step]), step
            assert same(reader.global_batch(step), want[step]), step
        assert len(leader._procs) == 1 and reader._procs == []  # the other rank runs no producer
        assert reader.state_dict() == leader.state_dict()  # either rank can checkpoint the data state
        assert leader.state_dict()["inner"] == local.state_dict()["inner"]
        assert "shared by its 2 ranks" in leader.describe()
    finally:
        leader.close(), reader.close()
    assert directory.is_dir()  # stopping producers keeps the spool for ranks still reading
    leader.release_spool()
    assert not directory.exists()


def test_producers_stay_queue_depth_ahead_of_the_slowest_rank_and_consumed_batches_are_freed(tmp_path):
    cfg = DataConfig(producers=2, queue_depth=2)  # synthetic
    (leader, reader), directory = node(tmp_path, cfg, 2, batch=2)
    try:
        leader.global_batch(0), leader.global_batch(1)
        time.sleep(1.0)  # room for a producer that ignored the slow reader to write step 2
        assert step_files(directory) == [0, 1]
        reader.global_batch(0)
        deadline = time.monotonic() + 20
        while 2 not in step_files(directory) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 2 in step_files(directory) and 3 not in step_files(directory)
        leader.global_batch(2)  # both have consumed step 0 now: the leader frees it
        assert 0 not in step_files(directory)
    finally:
        leader.close(), reader.close(), leader.release_spool()


def test_a_producer_failure_reaches_every_rank_of_the_host_as_one_line(tmp_path, fixtures_dir):
    # reorder needs dp_size * micro_batch to divide the batch: 3 samples over 2 ranks fails in the producer.
    cfg = dataclasses.replace(mmc4(fixtures_dir), producers=1, reorder=True)
    shape = dataclasses.replace(SHAPE, dp_size=2, micro_batch=1)
    shares = spool.plan_shares([("h", os.getpid())] * 2, "t1", tmp_path)
    leader, reader = build_source(cfg, shape, 3, 0), build_source(cfg, shape, 3, 0)
    leader.share_with(shares[0]), reader.share_with(shares[1])
    try:
        for src in (leader, reader):
            with pytest.raises(ProducerError) as err:
                src.global_batch(0)
            msg = str(err.value)
            assert msg.startswith("data.producers: producer 0 failed at step 0: ValueError: data.reorder:"), msg
            assert "\n" not in msg and "Traceback" in err.value.details
    finally:
        leader.close(), leader.release_spool()


def test_a_rank_whose_data_leader_is_gone_raises_instead_of_waiting(tmp_path):
    share = spool.plan_shares([("h", dead_pid()), ("h", os.getpid())], "t2", tmp_path)[1]
    src = build_source(DataConfig(producers=1), SHAPE, 2, 0)
    src.share_with(share)
    with pytest.raises(ProducerError, match=r"^data.producers: the data leader of this host \(rank 0\) is gone"):
        src.global_batch(0)


def test_stale_spools_of_dead_leaders_are_removed_and_nothing_else(tmp_path):
    stale = tmp_path / f"{spool.PREFIX}old"
    stale.mkdir()
    (stale / "owner").write_text(f"{spool.host_key()} {dead_pid()}\n")
    live = tmp_path / f"{spool.PREFIX}live"
    live.mkdir()
    (live / "owner").write_text(f"{spool.host_key()} {os.getpid()}\n")
    other_host = tmp_path / f"{spool.PREFIX}remote"
    other_host.mkdir()
    (other_host / "owner").write_text(f"elsewhere/boot {dead_pid()}\n")
    foreign = tmp_path / f"{spool.PREFIX}no-owner"
    foreign.mkdir()
    (tmp_path / "user_file").write_text("keep")
    assert spool.remove_stale(tmp_path) == [stale]
    assert live.is_dir() and other_host.is_dir() and foreign.is_dir() and (tmp_path / "user_file").exists()


def test_an_unusable_spool_dir_is_one_line_naming_the_setting(tmp_path):
    (tmp_path / "a_file").write_text("")
    share = spool.plan_shares([("h", os.getpid())], "t3", tmp_path / "a_file" / "spool")[0]
    src = build_source(DataConfig(producers=1), SHAPE, 2, 0)
    with pytest.raises(ProducerError, match=r"^data.spool_dir: cannot create a batch spool in .*a_file"):
        src.share_with(share)
