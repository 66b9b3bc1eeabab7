"""``disttrain-launch --elastic``: which slots a restart uses, when it re-plans, what it says, and
the command it builds (the job itself: tests/multiproc/test_elastic.py)."""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

import pytest

from disttrain_ds.cli import launch
from disttrain_ds.cost.profile_file import profile_from_dict
from disttrain_ds.errors import ConfigError
from disttrain_ds.launcher.elastic import ElasticPlan, first_slots, include_spec, lost_line, surviving
from disttrain_ds.recipe.graph import topology_of
from disttrain_ds.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
LAYOUT = ["layout=disaggregated", "parallel.encoder.dp=2", "parallel.llm.dp=2", "parallel.generator.dp=2"]
PROFILE = {"gpus": 8, "global_batch": 4, "microbatch": 1, "gpus_per_node": 8,
           "modules": {"encoder": {"layers": 4, "cost_ms": {"1": 10.0, "2": 6.0}},
                       "llm": {"layers": 4, "cost_ms": {"1": 40.0, "2": 22.0}},
                       "generator": {"layers": 3, "cost_ms": {"1": 12.0}}}}


def test_slots_are_taken_host_by_host_in_hostfile_order_and_written_as_deepspeeds_include():
    active = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [1, 3]}
    assert surviving(active, {"b"}) == {"a": [0, 1, 2, 3], "c": [1, 3]}
    assert first_slots(active, 6) == {"a": [0, 1, 2, 3], "b": [0, 1]}
    assert include_spec(first_slots(surviving(active, {"b"}), 5)) == "a:0,1,2,3@c:1"
    with pytest.raises(ValueError):
        first_slots(active, 11)


def test_the_lost_line_names_each_host_and_why():
    before = {"a": [0, 1], "b": [0, 1], "c": [0, 1, 2, 3]}
    assert lost_line(before, {"a": [0, 1], "c": [0, 1]}, {"b"}) == (
        "host b not answering, host c: 2 slots gone from the hostfile")
    assert lost_line(before, {"c": [0, 1, 2, 3]}, set()) == "host a gone from the hostfile, host b gone from the hostfile"


def _plan(active: dict[str, list[int]], profile: dict = PROFILE) -> ElasticPlan:
    return ElasticPlan(TINY, LAYOUT, profile_from_dict(profile), False, active, 8, [])


def test_nothing_lost_keeps_everything_and_says_nothing():
    step = _plan({"a": list(range(8))}).next({"a": list(range(8))}, set())
    assert (step.slots, step.layout, step.line) == ({"a": list(range(8))}, [], "")


def test_spare_slots_take_the_place_of_a_lost_host_without_a_re_plan():
    plan = _plan({"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]})
    step = plan.next({"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1, 2, 3]}, {"b"})
    assert step.slots == {"a": [0, 1, 2, 3], "c": [0, 1, 2, 3]} and step.layout == []
    assert step.line == ("elastic: host b not answering; 8 slots remain, the layout keeps its 8 ranks on them; "
                         "resuming from the newest checkpoint")


def test_fewer_slots_re_plan_the_recipe_into_a_layout_it_loads_with():
    plan = _plan({"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]})
    step = plan.next({"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}, {"b"})
    assert step.line.startswith("elastic: host b not answering; 4 slots remain; re-planned for ")
    recipe = load_recipe(TINY, [*LAYOUT, *step.layout])  # the planned degrees win over the user's
    topo = topology_of(recipe)
    assert topo.world_size == plan.world <= 4 and sum(map(len, step.slots.values())) == plan.world
    assert f"re-planned for {plan.world} GPUs: encoder dp={topo.module('encoder').dp} " in step.line
    again = plan.next({"a": [0, 1, 2, 3]}, set())  # the same 4 slots at the next restart: no second plan
    assert again.line == "" and again.layout == step.layout


def test_no_layout_for_what_is_left_is_one_line():
    plan = _plan({"a": [0, 1], "b": [0, 1, 2, 3, 4, 5]})
    with pytest.raises(ConfigError) as e:
        plan.next({"a": [0, 1]}, set())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("elastic: host b gone from the hostfile; cannot re-plan ") and \
        "for the 2 slots left: " in msg


# --- the launch command ---------------------------------------------------------------------------


@pytest.fixture
def run(run_main):
    return functools.partial(run_main, launch.main)


def _files(tmp_path, profile: dict = PROFILE) -> tuple[str, str]:
    (tmp_path / "hostfile").write_text("localhost slots=8\n")
    (tmp_path / "p.json").write_text(json.dumps(profile))
    return str(tmp_path / "hostfile"), str(tmp_path / "p.json")


@pytest.mark.parametrize("change, flags, words", [
    ({}, [], "--elastic re-plans when the job restarts: give --max-restarts N"),
    ({"global_batch": 8}, ["--max-restarts", "1"], "made for global batch 8 and micro batch 1, the recipe trains 4"),
    ({"modules": {"vision": {**PROFILE["modules"]["encoder"], "role": "encoder"}, "llm": PROFILE["modules"]["llm"]}},
     ["--max-restarts", "1"], "the profile's modules (vision, llm) are not the recipe's (encoder, llm, generator)"),
])
def test_elastic_the_launch_cannot_honour_is_refused_in_one_line(tmp_path, run, change, flags, words):
    hosts, profile = _files(tmp_path, {**PROFILE, **change})
    code, out, err = run("--hostfile", hosts, *flags, "--elastic", profile, "--recipe", TINY, *LAYOUT,
                         "train.steps=6", "checkpoint.every=2", "--dry-run")
    assert code == 2 and err.count("\n") == 1 and words in err, err


def test_the_relaunch_selects_the_slots_left_and_appends_the_planned_degrees(tmp_path):
    hosts, profile = _files(tmp_path)
    args = launch._parser().parse_intermixed_args(
        ["--hostfile", hosts, "--max-restarts", "1", "--elastic", profile, "--recipe", TINY, *LAYOUT,
         "train.steps=6", "checkpoint.every=2"])
    report, cmd, _, relaunch = launch.prepare(args)
    assert any(line.startswith("elastic: a restart that finds fewer than 8 slots") for line in report)
    resumed = [*cmd, "train.resume=auto"]
    assert relaunch(resumed) == resumed  # the hostfile still offers 8 slots
    Path(hosts).write_text("localhost slots=4\n")
    again = relaunch(resumed)
    assert again[again.index("--include") + 1] == "localhost:0,1,2,3" and "--hostfile" in again
    tail = again[again.index("--recipe") + 1:]
    assert tail[-1] == "train.resume=auto" and tail.index("parallel.llm.dp=2") < tail.index("layout=disaggregated", 2)
    recipe = load_recipe(tail[0], tail[1:])
    assert topology_of(recipe).world_size <= 4, shlex.join(again)


def test_a_torchrun_worker_replans_only_when_started_on_another_number_of_ranks():
    """``--elastic`` under torchrun (``planner/recipe_plan.py::worker_plan``): the recipe's own
    layout when the ranks match; else every worker computes the same plan for the ranks started,
    resuming from the newest checkpoint; a profile of another batch is refused in one line."""
    from disttrain_ds.planner.recipe_plan import worker_plan

    profile = profile_from_dict(PROFILE)
    recipe = load_recipe(TINY, LAYOUT)
    assert worker_plan(TINY, LAYOUT, recipe, profile, "p.json", 8) is None
    first, second = (worker_plan(TINY, LAYOUT, recipe, profile, "p.json", 5) for _ in range(2))
    assert first == second and first.ranks <= 5 and first.overrides[-1] == "train.resume=auto"
    assert topology_of(load_recipe(TINY, first.overrides)).world_size == first.ranks
    assert first.line.startswith("elastic: the recipe lays out 8 ranks, 5 started; re-planned for ")
    other = profile_from_dict({**PROFILE, "global_batch": 8})
    with pytest.raises(ConfigError) as e:
        worker_plan(TINY, LAYOUT, recipe, other, "p.json", 4)
    assert "\n" not in str(e.value) and "p.json: made for global batch 8" in str(e.value)
    with pytest.raises(ConfigError, match="cannot re-plan it for them"):
        worker_plan(TINY, LAYOUT, recipe, profile, "p.json", 2)  # three modules need 3 GPUs at least
