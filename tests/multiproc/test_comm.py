"""The inter-engine communicator on real gloo processes held to NCCL's point-to-point rules
(``comm/nccl_emulation.py``): fan-in/fan-out order, variable and empty shapes, gradient routing,
and a clear timeout when a peer is stuck."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback

import pytest
import torch

from disttrain_ds.comm.routes import broker_groups, routes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, queue, emulate, pg_timeout_s):
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain_ds.comm import nccl_emulation

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s))
        if emulate:
            nccl_emulation.install()
        queue.put((rank, "ok", fn(rank)))
    except Exception as exc:  # reported to the test, which asserts on it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, timeout: float = 120, emulate: bool = True, pg_timeout_s: float = 1800) -> dict:
    """Run ``fn(rank)`` on ``world`` gloo processes, under NCCL's rules unless ``emulate`` is off.
    Returns rank -> ("ok", value) | ("error", message) | ("died", exit code)."""
    import queue as queues

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, queue, emulate, pg_timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    import time

    results, deadline = {}, time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.5)
        except queues.Empty:
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in results):
                break  # the rest died without a report
            continue
        results[rank] = (status, value)
    for rank, p in enumerate(procs):
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
        if rank not in results:
            results[rank] = ("died", p.exitcode)
        elif p.exitcode:  # reported, then crashed on the way out (e.g. threads left in gloo)
            results[rank] = ("died", p.exitcode)
    return results


def _p2p(rank, timeout_s=30.0):
    import torch.distributed as dist

    from disttrain_ds.comm.p2p import P2P, PeerInfo, edge_channels, new_channel_groups

    names = {0: "encoder stage 0 dp 0", 1: "llm stage 0 dp 0", 2: "llm stage 0 dp 1"}
    return P2P(new_channel_groups(dist.get_world_size(), edge_channels([("encoder", "llm")])), rank, torch.device("cpu"), timeout_s, PeerInfo(names))


def _fan_out_case(rank):
    """Encoder dp=1 (rank 0) -> LLM dp=2 (ranks 1, 2): slot of 4 samples, variable rows per sample;
    in microbatch 2 the LLM's second replica gets nothing (its samples have no rows)."""
    from disttrain_ds.comm.boundary import BoundaryComm, boundary_links
    from disttrain_ds.topology import ModuleGrid

    up, down = ModuleGrid("encoder", 0, dp=1, pp=1), ModuleGrid("llm", 1, dp=2, pp=1)
    comm = BoundaryComm(_p2p(rank), up, down, 4, "image_embeds", (2,), torch.float32)
    comm.p2p.connect(boundary_links((up, down), 4, {"encoder": True, "llm": True}))
    out = {}
    all_rows = [[3, 1, 2, 5], [1, 1, 4, 2], [2, 1, 0, 0]]  # shapes change between microbatches
    mine = lambda rows: rows if rank == 0 else rows[2 * (rank - 1) : 2 * rank]  # noqa: E731
    if rank == 0:
        for mb, rows in enumerate(all_rows):  # every send first, then receives posted ahead of need
            act = torch.cat([torch.full((n, 2), float(10 * mb + i)) for i, n in enumerate(rows)])
            comm.send_activation(mb, act, rows)
            comm.prefetch_grad(mb, rows)
        for mb, rows in enumerate(all_rows):
            out[mb] = comm.recv_grad(mb, rows).tolist()
    else:
        comm.prefetch_activation(0, mine(all_rows[0]))
        for mb, rows in enumerate(all_rows):
            act = comm.recv_activation(mb, mine(rows))
            if mb + 1 < len(all_rows):
                comm.prefetch_activation(mb + 1, mine(all_rows[mb + 1]))
            out[mb] = act[:, 0].tolist()
            comm.send_grad(mb, act * 2, mine(rows))
    comm.p2p.flush_sends()
    return out


def test_fan_out_keeps_sample_order_and_gradients_route_back():
    res = run_ranks(3, _fan_out_case)
    assert all(s == "ok" for s, _ in res.values()), res
    # dp replica 0 of the LLM owns samples 0-1, replica 1 owns samples 2-3.
    assert res[1][1][0] == [0.0] * 3 + [1.0]
    assert res[2][1][0] == [2.0] * 2 + [3.0] * 5
    assert res[1][1][1] == [10.0, 11.0]
    assert res[2][1][1] == [12.0] * 4 + [13.0] * 2
    assert res[1][1][2] == [20.0] * 2 + [21.0] and res[2][1][2] == []
    # The encoder gets back the doubled activations in its own sample order.
    grads = torch.tensor(res[0][1][0])
    assert grads[:, 0].tolist() == [0.0] * 3 + [2.0] + [4.0] * 2 + [6.0] * 5


def _stuck_peer_case(rank):
    from disttrain_ds.comm.p2p import ACT, channel

    p2p = _p2p(rank, timeout_s=2.0)
    act = channel(ACT, "encoder", "llm")
    p2p.connect([(act, 0, 1)])
    if rank == 0:
        pending = p2p.irecv((3,), torch.float32, 1, act, "activation of microbatch 0")
        return pending.result().tolist()  # rank 1 never sends
    import time

    time.sleep(6)
    return None


def test_stuck_peer_raises_clear_timeout_instead_of_hanging():
    import time

    t0 = time.monotonic()
    res = run_ranks(2, _stuck_peer_case)
    status, msg = res[0]
    assert status == "error" and msg.startswith("CommTimeoutError")
    first = msg.splitlines()[0]
    assert "rank 0 (encoder stage 0 dp 0)" in first and "rank 1 (llm stage 0 dp 0)" in first
    assert "comm_timeout_s" in first
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("dp_up, dp_down", [(1, 2), (2, 1), (2, 3), (4, 6), (3, 3)])
def test_routes_cover_every_sample_once_in_order(dp_up, dp_down):
    slot = dp_up * dp_down * 2
    rs = routes(slot, dp_up, dp_down)
    covered = [s for r in sorted(rs, key=lambda r: r.samples.start) for s in r.samples]
    assert covered == list(range(slot))
    assert len(rs) == dp_up + dp_down - broker_groups(dp_up, dp_down)


def test_launch_with_wrong_world_size_is_refused_with_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(repo / "tools" / "train.py"), "--recipe", str(repo / "recipes" / "tiny_cpu.yaml"),
           "layout=disaggregated", f"logging.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: " + errors[0][len("error: "):]] and "needs 4 ranks" in errors[0]
    assert "but the job has 3" in errors[0]


def test_boundary_check_script_passes_under_nccl_rules(tmp_path):
    """tests/multiproc/run_boundary.py is also the NCCL check on GPUs (tests/gpu/test_nccl.py)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(repo / "tests" / "multiproc" / "run_boundary.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the emulation mode of this run (conftest)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r: json.loads((tmp_path / f"boundary_rank{r}.json").read_text()) for r in range(3)}
    assert got[2]["2"] == []  # its samples have no rows in microbatch 2: nothing crossed
    assert got[1]["0"] == [0.0] * 3 + [1.0] + [2.0] * 2


def _cross_edge_case(rank, shared: bool):
    """Encoder (0) -> LLM (1) -> generator (2), each graph edge on its own channel. The LLM posts
    its receive from the encoder ahead, then sends to the generator; the encoder sends only once the
    generator has its message. On a device-bound (eager) world a group is one lane per rank, so with
    one group for both edges (``shared``) the LLM's send waits behind the receive: a deadlock."""
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain_ds.comm.p2p import ACT, P2P, PeerInfo, channel, new_channel_groups

    names = [channel(ACT, "encoder", "llm"), channel(ACT, "llm", "generator")]
    groups = new_channel_groups(3, names)
    if shared:
        groups = {n: groups[names[0]] for n in names}
    p2p = P2P(groups, rank, torch.device("cpu"), 4.0, PeerInfo({0: "encoder", 1: "llm", 2: "generator"}))
    p2p.connect([(names[0], 0, 1), (names[1], 1, 2)])
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.wait(["generator got it"], timedelta(seconds=6))
        p2p.isend(torch.ones(2), 1, names[0], "activation of microbatch 1")
        p2p.flush_sends()
        return "sent"
    if rank == 1:
        ahead = p2p.irecv((2,), torch.float32, 0, names[0], "activation of microbatch 1")
        p2p.isend(torch.full((3,), 7.0), 2, names[1], "states of microbatch 0")
        p2p.flush_sends()
        return ahead.result().tolist()
    got = p2p.irecv((3,), torch.float32, 1, names[1], "states of microbatch 0").result().tolist()
    store.set("generator got it", "1")
    return got


def _cross_edge(rank):
    return _cross_edge_case(rank, shared=False)


def _cross_edge_shared(rank):
    return _cross_edge_case(rank, shared=True)


def test_a_receive_posted_ahead_on_one_edge_does_not_hold_up_a_send_on_another(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_NCCL_EMULATION", "eager")
    res = run_ranks(3, _cross_edge, timeout=60, pg_timeout_s=20)
    assert res == {0: ("ok", "sent"), 1: ("ok", [1.0, 1.0]), 2: ("ok", [7.0, 7.0, 7.0])}, res
    # Negative control: one group (one lane per rank) for both edges deadlocks until the deadline.
    res = run_ranks(3, _cross_edge_shared, timeout=60, pg_timeout_s=20)
    assert res[2][0] != "ok" and "CommTimeoutError" in str(res[1][1]) + str(res[2][1]), res
