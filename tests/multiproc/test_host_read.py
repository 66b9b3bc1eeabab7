"""Two emulated hosts (``DISTTRAIN_EMULATED_HOSTS``), each holding one DP replica of every module,
read disjoint halves of every global batch (``data.read: host``) and still train the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain_ds.data.host_read import EMULATED_HOSTS_ENV

from .conftest import launch, max_param_mismatch
from .test_data_formats_job import write_shards
from .test_fidelity import SGD, STEPS

# Ranks: encoder dp 0, 1; LLM dp 0, 1; generator dp 0, 1. Host a holds every replica 0.
HOSTS = {EMULATED_HOSTS_ENV: "a,b,a,b,a,b"}
LAYOUT = ["layout=disaggregated", "parallel.encoder.dp=2", "parallel.llm.dp=2", "parallel.llm.pp=1",
          "parallel.generator.dp=2", "parallel.heartbeat_timeout_s=120"]


def reads_by_host(out: Path) -> dict[str, set[tuple[int, int]]]:
    """(step, sample id) of every sample each host's ranks read."""
    names = HOSTS[EMULATED_HOSTS_ENV].split(",")
    got: dict[str, set] = {}
    for rank, host in enumerate(names):
        got.setdefault(host, set()).update(map(tuple, json.loads((out / f"reads_rank{rank}.json").read_text())))
    return got


def check_disjoint_halves(out: Path, steps: int, batch: int) -> None:
    reads = reads_by_host(out)
    assert not reads["a"] & reads["b"], "a sample was read on both hosts"
    assert len(reads["a"]) == len(reads["b"]) == steps * batch // 2
    assert {s for s, _ in reads["a"] | reads["b"]} == set(range(steps))


@pytest.mark.slow
def test_two_hosts_read_disjoint_samples_and_train_the_reference(tmp_path, reference_run):
    out = tmp_path / "job"
    rows, params, _ = launch(out, 6, [STEPS, *SGD, *LAYOUT], env_extra=HOSTS)
    ref_losses, ref_params = reference_run([STEPS, *SGD])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    check_disjoint_halves(out, 3, 4)
    log = (out / "launch.log").read_text()
    assert "each host reading only its ranks' samples (this host: 2 of 4)" in log
    # The logging rank read half the batch; its figures still cover the whole of it.
    assert all(r["samples_per_s"] * r["step_seconds"] == pytest.approx(4) for r in rows)


def expected_orders(overrides: list[str], steps: int, labels: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """The host-constrained order of each step's batch and its read order (sample ids), from one
    whole-batch read."""
    from disttrain_ds.cost.graph_costs import as_graph_costs
    from disttrain_ds.recipe.schema import load_recipe
    from disttrain_ds.reorder.inter import batch_order
    from disttrain_ds.runtime.setup import build_data_and_spec

    source, _ = build_data_and_spec(load_recipe("tiny_cpu", [*overrides, "data.reorder=false"]))
    shape, model = source.shape, as_graph_costs(source.shape.cost_model)
    out, read = [], []
    for step in range(steps):
        batch = source.global_batch(step)
        costs = model.costs([s.stats(shape.patch_size, source.special) for s in batch])
        out.append([batch[i].sample_id for i in batch_order(costs, model, shape.dp_size, shape.micro_batch, labels)])
        read.append([s.sample_id for s in batch])
    return out, read


@pytest.mark.slow  # the default tier keeps the reading plan: tests/unit
def test_two_hosts_reorder_their_own_samples_and_train_the_reference(tmp_path, reference_run):
    out = tmp_path / "job"
    data = ["train.global_batch=8", "data.reorder=true", "data.read=host"]
    rows, params, _ = launch(out, 6, [STEPS, *SGD, *LAYOUT, *data], env_extra=HOSTS)
    ref_losses, ref_params = reference_run([STEPS, *SGD, *data[:2]])  # reordered whole batches in one process
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    check_disjoint_halves(out, 3, 8)
    # Host a's ranks consume DP block 0 of every slot (even positions), host b's block 1.
    labels, names = [0, 1] * 4, HOSTS[EMULATED_HOSTS_ENV].split(",")
    reads = reads_by_host(out)
    whole = []
    for step in range(3):
        batch: list = [None] * 8
        for rank, host in enumerate(names):
            got = json.loads((out / f"ordered_rank{rank}.json").read_text())[step]
            assert [p for p, i in enumerate(got) if i is not None] == [p for p in range(8) if labels[p] == "ab".index(host)]
            assert all((step, i) in reads[host] for i in got if i is not None), "a host holds a sample it did not read"
            batch = [a if a is not None else b for a, b in zip(batch, got)]
        whole.append(batch)
    expected, unordered = expected_orders([*LAYOUT, "train.global_batch=8"], 3, labels)
    assert whole == expected  # every host applied the one order rank 0 computed
    assert whole != unordered, "no batch was reordered"


@pytest.mark.slow  # negative control of the test above, a whole job
def test_a_host_that_reads_another_hosts_samples_is_caught(tmp_path):
    proc = launch(tmp_path / "job", 6, ["train.steps=1", *SGD, *LAYOUT], fault="wrong_host_units", env_extra=HOSTS,
                  check=False)
    assert proc.returncode != 0
    assert "data.read: this host did not read samples" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_hosts_read_disjoint_shard_parts_and_train_the_reference(tmp_path, reference_run):
    path = write_shards(tmp_path / "shards")
    data = ["data.source=webdataset", f"data.path={path}", "data.shard_parts=2", f"data.cache_dir={tmp_path / 'cache'}"]
    out = tmp_path / "job"
    rows, params, _ = launch(out, 6, [STEPS, *SGD, *LAYOUT, *data], env_extra=HOSTS)
    ref_losses, ref_params = reference_run([STEPS, *SGD, *data])  # one process reads both parts
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    check_disjoint_halves(out, 3, 4)


@pytest.mark.slow
def test_hosts_reading_their_parts_through_producers_resume_exactly(tmp_path, reference_run):
    path = write_shards(tmp_path / "shards")
    spool = tmp_path / "spool"
    spool.mkdir()
    data = ["data.source=webdataset", f"data.path={path}", "data.shard_parts=2", f"data.cache_dir={tmp_path / 'cache'}"]
    job = [*SGD, *LAYOUT, *data, "data.producers=1", "data.queue_depth=2", f"data.spool_dir={spool}",
           "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ck'}"]
    out = tmp_path / "job"
    launch(out, 6, ["train.steps=2", *job], env_extra=HOSTS)
    # The checkpoint's data state holds each part as the host reading it left it.
    rows, params, _ = launch(out, 6, ["train.steps=4", *job], env_extra=HOSTS)  # resumes at step 2
    ref_losses, ref_params = reference_run(["train.steps=4", *SGD, *data])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    assert "resumed from" in (out / "launch.log").read_text()
    assert list(spool.iterdir()) == []


# Encoder dp 4 (ranks 0-3), LLM dp 2 (4, 5), generator dp 2 (6, 7); host a holds encoder replicas
# 0, 1 and every other replica 0, host b the rest: each host reads half of every microbatch.
POST_HOSTS = {EMULATED_HOSTS_ENV: "a,a,b,b,a,b,a,b"}
POST_LAYOUT = ["layout=disaggregated", "parallel.encoder.dp=4", "parallel.llm.dp=2", "parallel.llm.pp=1",
               "parallel.generator.dp=2", "parallel.post_balance=true", "parallel.heartbeat_timeout_s=120",
               "train.micro_batch=2", "train.global_batch=8", "data.read=host"]


@pytest.mark.slow
def test_post_balanced_replicas_split_their_own_hosts_samples_and_train_the_reference(tmp_path, reference_run):
    out = tmp_path / "job"
    rows, params, _ = launch(out, 8, [STEPS, *SGD, *POST_LAYOUT], env_extra=POST_HOSTS)
    ref_losses, ref_params = reference_run([STEPS, *SGD, "train.micro_batch=2", "train.global_batch=8"])
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    names = POST_HOSTS[EMULATED_HOSTS_ENV].split(",")
    reads = {}
    for rank, host in enumerate(names):
        reads.setdefault(host, set()).update(map(tuple, json.loads((out / f"reads_rank{rank}.json").read_text())))
    assert not reads["a"] & reads["b"] and len(reads["a"]) == len(reads["b"]) == 3 * 8 // 2
    assert "each host reading only its ranks' samples (this host: 4 of 8)" in (out / "launch.log").read_text()
