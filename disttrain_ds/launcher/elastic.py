"""``disttrain-launch --max-restarts N --elastic PROFILE``: a restart on the GPUs that remain.

Before each relaunch the hostfile is read again and its slots selected as at the start (the same
``--include`` / ``--exclude`` / ``--num_nodes`` / ``--num_gpus``); hosts that no longer answer on the
ssh port are left out. A scheduler that drops a dead node from the hostfile, or the node itself not
answering, both show up here. When fewer slots remain than the layout needs, the planner plans the
recipe for the slots left (``planner/recipe_plan.py``: degrees its model allows, the runtime's
memory check included), the relaunch selects exactly the planned number of slots with
``--include``, and the new degrees follow the user's overrides, so they win. The job resumes from
the newest checkpoint (``train.resume=auto``), re-sharded to the new layout; the global batch, and
with it the data order, stays what it was. One line per event says what was lost and the new layout.

The decisions are pure functions here; ``cli/launch.py`` reads the hostfile, probes the hosts and
builds the command.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disttrain_ds.cost.profile import Profile
from disttrain_ds.errors import ConfigError, plural
from disttrain_ds.planner.optimize import PlanError
from disttrain_ds.planner.recipe_plan import layout_line, layout_overrides, plan_for_recipe

Slots = dict[str, list[int]]
"""Host name -> slot ids, in hostfile order (what ``hostfile.select_slots`` returns)."""


def count(slots: Slots) -> int:
    return sum(len(ids) for ids in slots.values())


def surviving(active: Slots, unreachable: set[str]) -> Slots:
    """``active`` without the hosts that did not answer."""
    return {h: ids for h, ids in active.items() if h not in unreachable}


def first_slots(active: Slots, n: int) -> Slots:
    """The first ``n`` slots of ``active``, host by host in hostfile order."""
    out: Slots = {}
    for host, ids in active.items():
        take = ids[: n - count(out)]
        if take:
            out[host] = take
    if count(out) < n:
        raise ValueError(f"{n} slots asked of {count(active)}")
    return out


def include_spec(slots: Slots) -> str:
    """``slots`` as the ``deepspeed`` launcher's ``--include`` (``host:0,1@host2:0``)."""
    return "@".join(f"{h}:{','.join(map(str, ids))}" for h, ids in slots.items())


def lost_line(before: Slots, after: Slots, unreachable: set[str]) -> str:
    """What went missing between two selections, for the event line."""
    parts = []
    for host, ids in before.items():
        gone = len(set(ids) - set(after.get(host, ())))
        if host in unreachable:
            parts.append(f"host {host} not answering")
        elif host not in after:
            parts.append(f"host {host} gone from the hostfile")
        elif gone:
            parts.append(f"host {host}: {plural(gone, 'slot')} gone from the hostfile")
    return ", ".join(parts) or "no slot lost"


@dataclass
class Relaunch:
    """The next launch: the slots to use, the layout overrides (empty: the recipe's own), the line to say."""

    slots: Slots
    layout: list[str]
    line: str


@dataclass
class ElasticPlan:
    """What ``--elastic`` keeps between restarts."""

    recipe: str
    """The recipe as given (path or shipped name)."""
    overrides: list[str]
    """The user's ``key=value`` overrides (the planned degrees go after them)."""
    profile: Profile
    """The planner profile the re-plans use (its GPU count is replaced by the slots left)."""
    graph_form: bool
    """The recipe keeps its degrees in ``parallel.modules`` (else ``parallel.<role>``)."""
    active: Slots
    """The slots the current layout runs on."""
    world: int
    """Ranks the current layout needs."""
    layout: list[str]
    """The overrides of the current layout (empty until the first re-plan)."""

    def next(self, active: Slots, unreachable: set[str]) -> Relaunch:
        """The relaunch on ``active`` (the hostfile's selection now) less the ``unreachable``
        hosts; a one-line ``ConfigError`` when no layout runs on what is left."""
        alive = surviving(active, unreachable)
        if alive == self.active:
            return Relaunch(self.active, self.layout, "")
        lost, n = lost_line(self.active, alive, unreachable), count(alive)
        if n >= self.world:  # spare slots take the lost ones' place
            self.active = first_slots(alive, self.world)
            return Relaunch(self.active, self.layout, f"elastic: {lost}; {plural(n, 'slot')} remain, the layout "
                            f"keeps its {self.world} ranks on them; resuming from the newest checkpoint")
        try:
            result, _, _ = plan_for_recipe(self.recipe, replace(self.profile, gpus=n), self.graph_form,
                                           self.overrides)
        except (ConfigError, PlanError) as exc:
            raise ConfigError(f"elastic: {lost}; cannot re-plan {self.recipe} for the {plural(n, 'slot')} left: "
                              f"{exc}") from None
        self.world, self.layout = result.gpus, layout_overrides(result, self.graph_form)
        self.active = first_slots(alive, self.world)
        return Relaunch(self.active, self.layout, f"elastic: {lost}; {plural(n, 'slot')} remain; re-planned for "
                        f"{plural(self.world, 'GPU')}: {layout_line(result)}; resuming from the newest checkpoint")
