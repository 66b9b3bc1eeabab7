"""The NCCL-rules emulation is strict where gloo is lenient: the same two-rank programs pass on
plain gloo and fail under the emulation, as they would on NCCL. The last test holds the previous
inter-engine protocol (tagged header + payload, one group for both directions) to the rules."""

from __future__ import annotations

import pytest
import torch

from .test_comm import run_ranks


def _tags_case(rank):
    import torch.distributed as dist
    if rank == 0:
        works = [dist.isend(torch.full((4,), 1.0), 1, tag=1), dist.isend(torch.full((4,), 2.0), 1, tag=2)]
    else:
        second, first = torch.zeros(4), torch.zeros(4)
        works = [dist.irecv(second, 0, tag=2), dist.irecv(first, 0, tag=1)]  # posted out of order
    for w in works:
        w.wait()
    return None if rank == 0 else (first[0].item(), second[0].item())


@pytest.mark.parametrize("emulate, got", [(False, (1.0, 2.0)), (True, (2.0, 1.0))])
def test_messages_match_in_posting_order_not_by_tag(emulate, got):
    res = run_ranks(2, _tags_case, emulate=emulate, pg_timeout_s=5)
    assert res[0] == ("ok", None), res
    assert res[1] == ("ok", got), res


def _receive_ahead_case(rank):
    """Rank 0 posts a receive from rank 1, then a send rank 1 needs before it can answer."""
    import torch.distributed as dist
    if rank == 0:
        answer = torch.zeros(3)
        pending = dist.irecv(answer, 1)
        sent = dist.isend(torch.full((3,), 7.0), 1)
        sent.wait()
        pending.wait()
        return answer.tolist()
    got = torch.zeros(3)
    dist.recv(got, 0)
    dist.send(got * 2, 0)
    return got.tolist()


def test_a_receive_posted_ahead_blocks_later_sends_to_that_peer():
    assert run_ranks(2, _receive_ahead_case, emulate=False, pg_timeout_s=5) == {0: ("ok", [14.0] * 3), 1: ("ok", [7.0] * 3)}
    res = run_ranks(2, _receive_ahead_case, emulate=True, pg_timeout_s=5)
    assert all(status == "error" for status, _ in res.values()), res
    # The rank whose deadline passes first says so; the other may see the pair close before its own.
    assert any("timed out" in msg.lower() or "timeout" in msg.lower() for _, msg in res.values()), res


def _completion_case(rank):
    import time
    from datetime import timedelta

    import torch.distributed as dist
    if rank == 0:
        dist.recv(torch.zeros(1), 1)  # the pair is set up
        work = dist.irecv(torch.zeros(2), 1)
        done_early = work.is_completed()
        try:
            work.wait(timeout=timedelta(seconds=0.5))
            early_wait = "returned"
        except RuntimeError as exc:
            early_wait = "timed out" if "timed out" in str(exc) else str(exc)
        work.wait(timeout=timedelta(seconds=5))
        return [done_early, early_wait, work.is_completed()]
    dist.send(torch.ones(1), 0)
    time.sleep(1.5)
    dist.send(torch.ones(2), 0)
    return None


def test_emulated_work_reports_completion_and_honours_wait_timeouts():
    res = run_ranks(2, _completion_case, emulate=True, pg_timeout_s=5)
    assert res[0] == ("ok", [False, "timed out", True]), res


def _old_protocol_case(rank):
    """The protocol before the channel split, in miniature: each message is a shape header (tag 2k)
    then its payload (tag 2k+1); the receiver posts the next message's header receive before the
    current payload's (prefetch)."""
    import faulthandler

    faulthandler.disable()  # gloo aborts this process on purpose: no thread dump in the test log
    import torch.distributed as dist
    payloads = [torch.arange(6.0), torch.arange(3.0) + 10]
    if rank == 0:
        works = []
        for k, p in enumerate(payloads):
            works += [dist.isend(torch.tensor([p.numel()]), 1, tag=2 * k), dist.isend(p, 1, tag=2 * k + 1)]
        for w in works:
            w.wait()
        return None
    headers = [torch.zeros(1, dtype=torch.int64) for _ in payloads]
    h0 = dist.irecv(headers[0], 0, tag=0)
    h0.wait()
    h1 = dist.irecv(headers[1], 0, tag=2)  # prefetch of message 1's header
    first = torch.empty(int(headers[0]))
    dist.irecv(first, 0, tag=1).wait()
    h1.wait()
    second = torch.empty(int(headers[1]))
    dist.irecv(second, 0, tag=3).wait()
    return [first.tolist(), second.tolist()]


def test_header_prefetch_protocol_passes_gloo_and_fails_nccl_rules():
    ok = run_ranks(2, _old_protocol_case, emulate=False, pg_timeout_s=5)
    assert ok[1] == ("ok", [list(range(6)), [10.0, 11.0, 12.0]]), ok
    res = run_ranks(2, _old_protocol_case, emulate=True, timeout=60, pg_timeout_s=5)
    # The payload of message 0 lands in message 1's header receive: gloo aborts on the size.
    assert res[1][0] in ("error", "died"), res


ONE_CHANNEL = ["layout=disaggregated", "train.steps=1", "parallel.comm_timeout_s=15", "parallel.heartbeat_timeout_s=15"]


@pytest.mark.slow  # waits out a 15 s deadline; the one-stream rule itself is pinned above without a job
def test_one_group_for_both_directions_stops_the_readme_layout_under_nccl_rules(tmp_path):
    """Negative control at layout level: activations and gradients on one process group (one
    stream per pair) let the encoder's gradient receive for microbatch 0 hold up its activation
    send for microbatch 1, which the LLM needs first. Under NCCL's rules the job stops, naming a
    timed-out transfer."""
    from .conftest import launch

    proc = launch(tmp_path, 4, ONE_CHANNEL, fault="one_channel", check=False, timeout=300)
    assert proc.returncode != 0
    assert "CommTimeoutError" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_one_group_for_both_directions_passes_on_plain_gloo(tmp_path):
    """...which plain gloo hides: the same job trains."""
    from .conftest import launch

    rows, _, _ = launch(tmp_path, 4, ONE_CHANNEL, fault="one_channel", env_extra={"DISTTRAIN_NCCL_EMULATION": "0"})
    assert [r["step"] for r in rows] == [1]
