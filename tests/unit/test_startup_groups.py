"""Start-up rules without processes: the job's group plan, the emulated split's verdicts, backend
agreement, device choice, and the refusal of member-only groups on a device-bound world."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as tdist

from disttrain_ds.comm import nccl_emulation as emu
from disttrain_ds.comm.p2p import edge_channels
from disttrain_ds.errors import ConfigError
from disttrain_ds.parallel import groups as pg
from disttrain_ds.parallel.grid import GRID_AXES
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe
from disttrain_ds.runtime import startup
from disttrain_ds.topology import ModuleGrid, Topology


def _mixed_tp() -> Topology:
    return topology_of(load_recipe("tiny_cpu", ["layout=disaggregated", "parallel.llm.tp=2",
                                                         "parallel.encoder.dp=2", "train.micro_batch=2"]))


def test_group_plan_gives_every_rank_one_group_per_axis_of_its_module():
    topo = _mixed_tp()
    world = sum(m.size for m in topo.modules)
    specs = pg.plan_groups(topo.modules, world)
    assert specs[0] == pg.GroupSpec((pg.META,), tuple(range(world)), "gloo")
    # One group per graph edge and direction, of the two modules' boundary ranks only.
    edges = [(a.name, b.name) for a, b in zip(topo.modules, topo.modules[1:])]
    chans = [s for s in specs if s.key[0] == "channel"]
    assert [s.key[1] for s in chans] == edge_channels(edges)
    for s, (up, down) in zip(chans, [e for e in edges for _ in range(2)]):
        u, d = (next(m for m in topo.modules if m.name == n) for n in (up, down))
        assert set(s.ranks) == {r for r in u.ranks if u.coords(r)[0] == u.pp - 1} | {r for r in d.ranks if d.coords(r)[0] == 0}
    for m in topo.modules:
        for axis in GRID_AXES:
            mine = [s for s in specs if s.key[:2] == (m.name, axis)]
            covered = sorted(r for s in mine for r in s.ranks)
            assert covered == list(m.ranks), (m.name, axis)  # a partition of the module's ranks
    llm = next(m for m in topo.modules if m.name == "llm")
    tp_groups = [s.ranks for s in specs if s.key[:2] == ("llm", "model")]
    assert sorted(tp_groups) == sorted(tuple(g) for g in llm.tp_groups())


def test_group_plan_is_one_list_whatever_the_rank_and_keys_are_unique():
    topo = _mixed_tp()
    world = sum(m.size for m in topo.modules)
    a, b = pg.plan_groups(topo.modules, world), pg.plan_groups(topo.modules, world)
    assert a == b
    assert len({s.key for s in a}) == len(a)


def test_process_groups_make_every_group_on_every_rank_and_keep_their_own():
    grid = ModuleGrid("llm", first_rank=1, dp=1, pp=2, tp=2)
    enc = ModuleGrid("encoder", first_rank=0, dp=1, pp=1, tp=1)
    specs = pg.plan_groups((enc, grid), 5)
    calls = []

    def fake_new_group(ranks, timeout=None, backend=None):
        calls.append((tuple(ranks), timeout, backend))
        return f"pg{len(calls)}"

    made = pg.ProcessGroups(rank=0).make(specs, 37.0, new_group=fake_new_group)
    assert [c[0] for c in calls] == [s.ranks for s in specs]  # rank 0 made the LLM's groups too
    assert all(c[1] == timedelta(seconds=37.0) for c in calls)
    assert made.made == len(specs)
    axes = made.module_axes("encoder")
    assert set(axes) == set(GRID_AXES) and all(r == [0] for r, _ in axes.values())
    with pytest.raises(KeyError):
        made.module_axes("llm")


def test_split_joiners_follow_torch_on_a_device_bound_world():
    assert emu.split_joiners([1, 2], 4, None, local=False) == [0, 1, 2, 3]
    assert emu.split_joiners([1, 2], 4, None, local=True) == [1, 2]
    assert emu.split_joiners([1, 2], 4, "gloo", local=False) == [0, 3]  # torch splits off the non-members only
    assert emu.split_joiners([0, 1, 2, 3], 4, "gloo", local=False) == []


def test_split_problem_names_missing_ranks_and_disagreeing_ranks():
    same = {r: {"ranks": [1, 2]} for r in range(4)}
    assert emu.split_problem(same, 4) is None
    missing = emu.split_problem({1: {"ranks": [1, 2]}, 2: {"ranks": [1, 2]}}, 4)
    assert "ranks 0, 3 did not take part" in missing and "[1, 2]" in missing
    mixed = emu.split_problem({0: {"ranks": [0]}, 1: {"ranks": [1, 2]}, 2: {"ranks": [1, 2]}, 3: {"ranks": [3]}}, 4)
    assert "made different groups" in mixed and "ranks 1, 2 the group of ranks [1, 2]" in mixed


def test_emulation_mode_from_environment(monkeypatch):
    for value, want in (("", None), ("0", None), ("1", "lazy"), ("lazy", "lazy"), ("eager", "eager")):
        monkeypatch.setenv(emu.ENV, value)
        assert emu.mode() == want
    monkeypatch.setenv(emu.ENV, "eagre")
    with pytest.raises(ValueError, match="DISTTRAIN_NCCL_EMULATION='eagre'"):
        emu.mode()


def test_backend_is_agreed_or_refused_in_one_line():
    assert startup.backend_for(8, 8) == "nccl"
    assert startup.backend_for(0, 8) == "gloo"
    with pytest.raises(ConfigError, match="3 of 8 ranks see a GPU and 5 do not"):
        startup.backend_for(3, 8)


class _CountingStore:
    """A thread-safe dict store counting operations."""

    def __init__(self):
        self.data: dict[str, int | str] = {}
        self.ops = 0
        self.lock = threading.Lock()

    def add(self, key, n):
        with self.lock:
            self.ops += 1
            self.data[key] = int(self.data.get(key, 0)) + n
            return self.data[key]

    def set(self, key, value):
        with self.lock:
            self.ops += 1
            self.data[key] = value

    def check(self, keys):
        with self.lock:
            self.ops += 1
            return all(k in self.data for k in keys)


@pytest.mark.parametrize("gpus,want", [(0, "gloo"), (16, "nccl"), (5, None)])
def test_backend_agreement_gives_every_rank_one_answer(gpus, want):
    store, world = _CountingStore(), 16
    out: dict[int, str] = {}

    def rank(r: int) -> None:
        try:
            out[r] = startup.agree_backend(store, world, cuda=r < gpus, timeout_s=5.0, poll_s=0.01)
        except ConfigError as exc:
            out[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out.values())) == 1  # the same answer, or the same line, everywhere
    if want:
        assert out[0] == want
    else:
        assert "5 of 16 ranks see a GPU" in out[0]


def test_backend_agreement_times_out_naming_how_many_ranks_came():
    store = _CountingStore()
    with pytest.raises(ConfigError, match="only 1 of 4 ranks started within 0 s"):
        startup.agree_backend(store, 4, cuda=True, timeout_s=0.05, poll_s=0.01)


def test_device_is_local_rank_modulo_visible_devices():
    assert startup.device_index(5, 8) == 5
    assert startup.device_index(5, 1) == 0  # the launcher shows each process its own GPU only
    with pytest.raises(ConfigError, match="no CUDA device"):
        startup.device_index(0, 0)


def test_nccl_deadline_is_past_the_projects_own():
    assert startup.nccl_timeout_s(300) > 300


def test_cuda_launch_blocking_is_refused_on_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.delenv(emu.ENV, raising=False)
    with pytest.raises(ConfigError, match="CUDA_LAUNCH_BLOCKING=1 deadlocks"):
        startup.refuse_unsafe_environment(cuda=True)
    startup.refuse_unsafe_environment(cuda=False)  # harmless on CPU


def test_member_only_group_is_refused_once_the_guard_is_on(monkeypatch):
    made = []
    monkeypatch.setattr(tdist, "new_group", lambda ranks=None, *a, **kw: made.append(ranks) or "pg")
    pg.refuse_member_only_groups()
    assert tdist.new_group([0, 1, 2]) == "pg"
    with pytest.raises(pg.StartupError, match=r"ranks \[1, 2\] made by its members only"):
        tdist.new_group([2, 1], use_local_synchronization=True)
    assert made == [[0, 1, 2]]
    pg.refuse_member_only_groups()  # idempotent: one wrapper
    assert tdist.new_group([3]) == "pg" and made[-1] == [3]


def test_without_the_guard_member_only_groups_pass(monkeypatch):
    """Negative control for the guard: the plain call goes through."""
    made = []
    monkeypatch.setattr(tdist, "new_group", lambda ranks=None, *a, **kw: made.append(ranks) or "pg")
    assert tdist.new_group([1, 2], use_local_synchronization=True) == "pg"
