"""A profile's JSON file: reading it with every field checked (one line naming the field and the
file on any problem, so a typo never turns into a silently wrong plan), and writing it back
(``docs/planner.md`` has the schema)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from disttrain_ds.configtools import load_json
from disttrain_ds.cost.profile import (
    COST_SOURCES,
    TP_DEGREES,
    ModuleProfile,
    Profile,
    ProfileError,
    check_draws,
    default_role,
    roles_graph,
)
from disttrain_ds.graph import DEFAULT_ROLES, ROLES

_TOP_FIELDS = ("gpus", "global_batch", "modules", "microbatch", "gpus_per_node", "gpu_memory_gb",
               "peak_tflops", "description", "post_balance_share")
_MODULE_FIELDS = ("layers", "cost_ms", "params", "frozen", "weight_bytes_per_param",
                  "grad_bytes_per_param", "optimizer_bytes_per_param",
                  "activation_bytes_per_sample", "activation_tp_sharded", "flops_per_sample", "activation_checkpointing",
                  "layer_output_bytes_per_sample", "sample_cost_ms", "unit_cost_ms", "cost_source",
                  "sp_overhead_ms", "attention_heads")
_NUMBER_FIELDS = _MODULE_FIELDS[2:-5]  # written only when they differ from the default


def _fail(src: str, key: str, what: str) -> ProfileError:
    return ProfileError(f"{src}: '{key}' {what}")


def _int(data: dict, name: str, key: str, src: str, default: Any = ..., low: int = 1) -> int:
    if name not in data:
        if default is ...:
            raise ProfileError(f"{src}: missing required field '{key}'")
        return default
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(src, key, f"must be an integer, got {value!r}")
    if value < low:
        raise _fail(src, key, f"must be >= {low}, got {value}")
    return value


def _num(data: dict, name: str, key: str, src: str, default: Any, positive: bool = False) -> Any:
    if name not in data or (data[name] is None and default is None):
        return default
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(src, key, f"must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise _fail(src, key, f"must be {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def _check_keys(data: Any, known: tuple[str, ...], prefix: str, src: str) -> None:
    if not isinstance(data, dict):
        raise _fail(src, prefix.rstrip(".") or "<root>", "must be a JSON object")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ProfileError(f"{src}: unknown field '{prefix}{unknown[0]}' "
                           f"(known here: {', '.join(known)})")


def _role(data: Any, name: str, src: str) -> str:
    if not isinstance(data, dict):
        raise _fail(src, f"modules.{name}", "must be a JSON object")
    if "role" not in data:
        return default_role(name, src)
    role = data["role"]
    if role not in ROLES:
        raise _fail(src, f"modules.{name}.role",
                    f"must be one of {' | '.join(ROLES)}, got {role!r}")
    return role


def _module_from_dict(data: Any, name: str, src: str) -> ModuleProfile:
    pre = f"modules.{name}."
    _check_keys(data, ("role",) + _MODULE_FIELDS, pre, src)
    if "cost_ms" not in data:
        raise ProfileError(f"{src}: missing required field '{pre}cost_ms'")
    raw = data["cost_ms"]
    if not isinstance(raw, dict) or not raw:
        raise _fail(src, pre + "cost_ms", "must be a non-empty object {\"tp\": ms}")
    cost: dict[int, float] = {}
    for k, v in raw.items():
        if str(k) not in {str(t) for t in TP_DEGREES}:
            raise _fail(src, f"{pre}cost_ms.{k}", "is not a TP degree (use 1, 2, 4 or 8)")
        cost[int(k)] = _num(raw, k, f"{pre}cost_ms.{k}", src, None, positive=True)
        if cost[int(k)] is None:
            raise _fail(src, f"{pre}cost_ms.{k}", "must be a number, got None")
    sources = data.get("cost_source", {})
    if not isinstance(sources, dict):
        raise _fail(src, pre + "cost_source", "must be an object {\"tp\": measured | interpolated | assumed}")
    for k, v in sources.items():
        if str(k) not in raw:
            raise _fail(src, f"{pre}cost_source.{k}", f"names no degree of {pre}cost_ms ({', '.join(raw)})")
        if v not in COST_SOURCES:
            raise _fail(src, f"{pre}cost_source.{k}", f"must be one of {' | '.join(COST_SOURCES)}, got {v!r}")
    frozen = data.get("frozen", False)
    if not isinstance(frozen, bool):
        raise _fail(src, pre + "frozen", f"must be true or false, got {frozen!r}")
    d = ModuleProfile(layers=1, cost_ms={})  # defaults, so they are written down only once
    return ModuleProfile(
        layers=_int(data, "layers", pre + "layers", src),
        cost_ms=dict(sorted(cost.items())),
        params=_num(data, "params", pre + "params", src, d.params),
        frozen=frozen,
        weight_bytes_per_param=_num(data, "weight_bytes_per_param",
                                    pre + "weight_bytes_per_param", src, d.weight_bytes_per_param),
        grad_bytes_per_param=_num(data, "grad_bytes_per_param", pre + "grad_bytes_per_param",
                                  src, d.grad_bytes_per_param),
        optimizer_bytes_per_param=_num(data, "optimizer_bytes_per_param",
                                       pre + "optimizer_bytes_per_param", src,
                                       d.optimizer_bytes_per_param),
        activation_bytes_per_sample=_num(data, "activation_bytes_per_sample",
                                         pre + "activation_bytes_per_sample", src,
                                         d.activation_bytes_per_sample),
        activation_tp_sharded=_fraction(data, pre + "activation_tp_sharded", src),
        flops_per_sample=_num(data, "flops_per_sample", pre + "flops_per_sample", src, None),
        sample_cost_ms=_draw(data, pre + "sample_cost_ms", src),
        unit_cost_ms=_unit_draw(data, pre + "unit_cost_ms", src),
        activation_checkpointing=_int(data, "activation_checkpointing", pre + "activation_checkpointing",
                                      src, 0, low=0),
        layer_output_bytes_per_sample=_num(data, "layer_output_bytes_per_sample",
                                           pre + "layer_output_bytes_per_sample", src,
                                           d.layer_output_bytes_per_sample),
        cost_source={int(k): v for k, v in sources.items()},
        sp_overhead_ms=_sp_overhead(data, pre + "sp_overhead_ms", src),
        attention_heads=_heads(data, pre + "attention_heads", src),
    )


def _sp_overhead(data: dict, key: str, src: str) -> dict[int, float]:
    """``sp_overhead_ms``: {"sp": ms >= 0} with SP degrees 2, 4, 8 (or more, powers of two)."""
    raw = data.get("sp_overhead_ms", {})
    if not isinstance(raw, dict):
        raise _fail(src, key, "must be an object {\"sp\": ms}")
    out = {}
    for k, v in raw.items():
        if not str(k).isdigit() or int(k) < 2 or int(k) & (int(k) - 1):
            raise _fail(src, f"{key}.{k}", "is not an SP degree (a power of two, at least 2)")
        out[int(k)] = _num(raw, k, f"{key}.{k}", src, None)
        if out[int(k)] is None:
            raise _fail(src, f"{key}.{k}", "must be a number, got None")
    return dict(sorted(out.items()))


def _heads(data: dict, key: str, src: str) -> tuple[int, int]:
    """``attention_heads``: [query heads, KV heads], KV heads dividing the query heads."""
    raw = data.get("attention_heads", [0, 0])
    if (not isinstance(raw, list) or len(raw) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                                                           for x in raw) or (raw[1] and raw[0] % raw[1])):
        raise _fail(src, key, f"must be [query heads, KV heads] (KV heads dividing them), got {raw!r}")
    return raw[0], raw[1]


def _fraction(data: dict, key: str, src: str) -> float:
    """``activation_tp_sharded``: a number from 0 to 1, 0 when absent."""
    raw = data.get("activation_tp_sharded", 0.0)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 <= raw <= 1:
        raise _fail(src, key, f"must be a number from 0 to 1, got {raw!r}")
    return float(raw)


def _draw(data: dict, key: str, src: str) -> tuple[float, ...] | None:
    """``sample_cost_ms``: a non-empty list of finite numbers >= 0, or absent. Zeros are real data: a
    sample without images costs an encoder nothing, one without targets a generator nothing."""
    if "sample_cost_ms" not in data:
        return None
    raw = data["sample_cost_ms"]
    if not isinstance(raw, list) or not raw:
        raise _fail(src, key, "must be a non-empty list of ms per sample")
    return _ms_list(raw, key, src, "ms of one sample")


def _ms_list(raw: list, key: str, src: str, what: str) -> tuple[float, ...]:
    """Every entry of ``raw`` a finite number >= 0 (one line naming the first that is not)."""
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise _fail(src, f"{key}[{i}]", f"must be a finite number >= 0 ({what}), got {v!r}")
    return tuple(float(v) for v in raw)


def _unit_draw(data: dict, key: str, src: str) -> tuple[tuple[float, ...], ...] | None:
    """``unit_cost_ms``: per sample of the draw, a list of its units' ms (finite, >= 0), or absent."""
    if "unit_cost_ms" not in data:
        return None
    raw = data["unit_cost_ms"]
    if not isinstance(raw, list) or not raw:
        raise _fail(src, key, "must be a non-empty list with one list of unit ms per sample")
    for i, units in enumerate(raw):
        if not isinstance(units, list):
            raise _fail(src, f"{key}[{i}]", f"must be a list of ms per unit of one sample, got {units!r}")
    return tuple(_ms_list(units, f"{key}[{i}]", src, "ms of one unit") for i, units in enumerate(raw))


def profile_from_dict(data: Any, src: str = "<profile>") -> Profile:
    """Validate a parsed profile JSON object; ``src`` names the file in error messages."""
    _check_keys(data, _TOP_FIELDS, "", src)
    if "modules" not in data:
        raise ProfileError(f"{src}: missing required field 'modules'")
    mods = data["modules"]
    if not isinstance(mods, dict):
        raise _fail(src, "modules", "must be a JSON object")
    graph = roles_graph({name: _role(spec, name, src) for name, spec in mods.items()}, src)
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _fail(src, "description", f"must be a string, got {description!r}")
    modules = {name: _module_from_dict(mods[name], name, src) for name in graph.names}
    check_draws(modules, src)
    return Profile(
        gpus=_int(data, "gpus", "gpus", src),
        global_batch=_int(data, "global_batch", "global_batch", src),
        modules=modules,
        microbatch=_int(data, "microbatch", "microbatch", src, 1),
        gpus_per_node=_int(data, "gpus_per_node", "gpus_per_node", src, 8),
        gpu_memory_gb=_num(data, "gpu_memory_gb", "gpu_memory_gb", src, None, positive=True),
        peak_tflops=_num(data, "peak_tflops", "peak_tflops", src, None, positive=True),
        description=description,
        post_balance_share=_share(data, src),
        graph=graph,
    )


def _share(data: dict, src: str) -> float:
    value = _num(data, "post_balance_share", "post_balance_share", src, 0.0)
    if value != 0 and value < 1:
        raise _fail(src, "post_balance_share", f"must be 0 (no post-balancing) or >= 1, got {value!r}")
    return float(value)


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile JSON file (one-line ``ProfileError`` on any problem)."""
    return profile_from_dict(load_json(path, ProfileError), src=str(path))


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """JSON-ready view of ``profile`` that ``profile_from_dict`` reads back unchanged."""
    out: dict[str, Any] = {"gpus": profile.gpus, "global_batch": profile.global_batch,
                           "microbatch": profile.microbatch,
                           "gpus_per_node": profile.gpus_per_node}
    for key in ("gpu_memory_gb", "peak_tflops"):
        if getattr(profile, key) is not None:
            out[key] = getattr(profile, key)
    if profile.description:
        out["description"] = profile.description
    if profile.post_balance_share:
        out["post_balance_share"] = profile.post_balance_share
    out["modules"] = {}
    for name in profile.graph.names:
        spec, role = profile.modules[name], profile.graph.role(name)
        mod: dict[str, Any] = {} if role == DEFAULT_ROLES.get(name) else {"role": role}
        mod.update(layers=spec.layers, cost_ms={str(t): c for t, c in spec.cost_ms.items()})
        for f in _NUMBER_FIELDS:
            value = getattr(spec, f)
            if value != getattr(ModuleProfile(1, {}), f):  # write only what differs from default
                mod[f] = value
        if spec.sample_cost_ms is not None:
            mod["sample_cost_ms"] = list(spec.sample_cost_ms)
        if spec.unit_cost_ms is not None:
            mod["unit_cost_ms"] = [list(u) for u in spec.unit_cost_ms]
        if spec.cost_source:
            mod["cost_source"] = {str(t): v for t, v in sorted(spec.cost_source.items())}
        if spec.sp_overhead_ms:
            mod["sp_overhead_ms"] = {str(s): v for s, v in spec.sp_overhead_ms.items()}
        if any(spec.attention_heads):
            mod["attention_heads"] = list(spec.attention_heads)
        out["modules"][name] = mod
    return out


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as indented JSON."""
    Path(path).write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")
