"""What a record source's data state is checked against on resume, in the layouts earlier versions hashed.

A data state names the source it was read from by a hash of everything that decides the samples:
format, path, seed, batch, the ``data`` section and the model's shape facts. Facts that only order
or place a batch's samples (the DP split, where parts sit, the cost model reordering prices with)
are left out, so a resumed run may change them. States written by earlier versions hashed some of
those facts, and hashed the shape facts in the layout ``ShapeSpec`` had then (the first generator's
fields apart from the others'); ``known_fingerprints`` recomputes each layout so they still load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from typing import Any

from disttrain_ds.cost.graph_costs import GraphCosts
from disttrain_ds.cost.model import TERMS, CostModel
from disttrain_ds.data.split import Split
from disttrain_ds.families import DEFAULT_FAMILY, FAMILIES, default_config
from disttrain_ds.samples import ShapeSpec

_GEN_FIELDS = (*TERMS["generator"], "gen_downsample")


def shape_facts(shape: ShapeSpec, costs_as_hashed: bool) -> dict:
    """``shape`` in the layout fingerprints hash: the first generator's resolution, channels and
    query tokens as fields of their own, the others in ``more_gens``. ``costs_as_hashed``: the cost
    model as versions before per-module cost terms hashed it; otherwise left out (None)."""
    first = shape.gens[0]
    return {
        "patch_size": shape.patch_size, "gen_resolution": first.resolution, "gen_channels": first.channels,
        "query_tokens": first.query_tokens, "audio_mels": shape.audio_mels, "audio_max_frames": shape.audio_max_frames,
        "dp_size": shape.dp_size, "micro_batch": shape.micro_batch,
        "cost_model": _costs_as_hashed(shape.cost_model) if costs_as_hashed else None,
        "vae": asdict(shape.vae) if shape.vae is not None else None,
        "more_gens": tuple(asdict(g) for g in shape.gens[1:]), "gen_name": first.name, "columns": shape.columns,
    }


def _costs_as_hashed(costs: Any) -> Any:
    """A ``GraphCosts`` as it was laid out when one shared model held the image encoder's, the first
    generator's and the audio encoder's terms (a stand-in's where the graph had none) and further
    generators had models of their own."""
    if not isinstance(costs, GraphCosts):
        return asdict(costs) if isinstance(costs, CostModel) else costs
    by_kind = {kind: next((n for n, k in costs.kinds.items() if k == kind), None) for kind in TERMS}
    shared: dict[str, float] = {}
    for kind, fields, role in (("encoder", TERMS["encoder"], "encoder"), ("generator", _GEN_FIELDS, "generator")):
        name = by_kind[kind]
        if name is None:
            stand_in = FAMILIES[DEFAULT_FAMILY[role]].cost_terms(default_config(role))
            shared.update({f: stand_in[f] for f in fields})
        else:
            shared.update({f: getattr(costs.own.get(name, costs.model), f) for f in fields})
    if by_kind["audio"] is not None:
        shared.update({f: getattr(costs.own.get(by_kind["audio"], costs.model), f) for f in TERMS["audio"]})
    model = replace(costs.model, **shared)
    more = [n for n, k in costs.kinds.items() if k == "generator"][1:]
    gen_models = {n: asdict(replace(model, **{f: getattr(costs.own.get(n, costs.model), f) for f in _GEN_FIELDS}))
                  for n in more}
    return {"model": asdict(model), "kinds": dict(costs.kinds), "gen_models": gen_models}


def data_fingerprint(head: list, data: dict, shape: ShapeSpec, split: Split, unused: tuple[str, ...], *,
                     dp_split: bool = False, later_keys: bool = False, costs_as_hashed: bool = False) -> str:
    """The hash of a record source's setup: ``head`` (format, path, records, seed, batch), the ``data``
    section (as a dict), ``shape`` and ``split``; ``unused``: data keys the format ignores.

    The keyword arguments give the layouts of earlier versions: ``dp_split``: with the DP split
    (before it was left out); ``later_keys``: with the shape's ``vae`` and ``more_gens`` even when
    unused; ``costs_as_hashed``: with the cost model (``shape_facts``)."""
    data = dict(data)
    for drop in ("producers", "queue_depth", "reorder", "cache_dir", "read", *unused):  # do not change the samples
        data.pop(drop, None)
    if not data.get("max_seq_len"):  # off (0): packed as before the field existed
        data.pop("max_seq_len", None)
    facts = shape_facts(shape, costs_as_hashed)
    facts.pop("columns")  # where parts' samples sit in the global batch, not what they are
    if not facts["more_gens"]:  # one generator: runs from before generators were named keep their fingerprint
        facts.pop("gen_name")
    for key in ("vae", "more_gens"):  # unused (None, no other generator): the fingerprint of the versions before them
        if not later_keys and not facts[key]:
            facts.pop(key)
    out = [*head, data, facts]
    if split.fraction > 0 or split.held_out:  # runs without a hold-out keep their fingerprint
        out.append(asdict(split))
    if not dp_split:  # the layout's DP split only regroups a batch (data.reorder): resuming may change it
        for drop in ("dp_size", "micro_batch"):
            facts.pop(drop)
    return hashlib.sha256(json.dumps(out, sort_keys=True, default=str).encode()).hexdigest()[:16]


def known_fingerprints(head: list, data: dict, shape: ShapeSpec, split: Split, unused: tuple[str, ...]) -> set[str]:
    """Every fingerprint a state of this setup may carry: this version's and earlier versions' layouts."""
    return {data_fingerprint(head, data, shape, split, unused, dp_split=a, later_keys=b, costs_as_hashed=c)
            for a in (False, True) for b in (False, True) for c in (False, True)}
