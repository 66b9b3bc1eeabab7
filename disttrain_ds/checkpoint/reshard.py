"""Resuming a module under another layout: full per-parameter tensors out of the saved shards, then
this rank's shards of them into a freshly built engine.

A checkpoint's module folder holds DeepSpeed's files of the layout that wrote it: one file per
(layer, TP index) with the layer's weights, and the optimizer state either per parameter (a torch
optimizer, ZeRO stage 0, in ``mp_rank_XX_model_states.pt``) or as flat fp32 partitions over the DP
replicas (ZeRO-1 and the bf16 optimizer, ``*zero_pp_rank_D_mp_rank_XX_optim_states.pt``, with
DeepSpeed's ``param_slice_mappings``). The manifest adds what the files do not say: which rank
(stage, DP, TP index) wrote which file, its layers, its optimizer kind, the order of its optimizer's
parameters and how TP split each parameter (``describe_rank``).

``read_module`` rebuilds, for the layers a rank now holds, one ``ParamState`` per parameter: the
full weight, fp32 master, per-element optimizer state (``exp_avg``, ``exp_avg_sq``, ...) and step
count, keyed ``<layer index>.<param>`` as DeepSpeed's PipelineModule names them. ``load_into_engine``
cuts this rank's TP shard of each and writes it into the engine's parameters and optimizer (torch
state per parameter, or the ZeRO/bf16 flat partition through DeepSpeed's fragment addresses).
Everything read goes through the caller's ``load`` (manifest-listed files, ``weights_only``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from disttrain_ds.checkpoint.read import LAYER_FILE
from disttrain_ds.errors import ConfigError
from disttrain_ds.parallel.tensor_parallel import merge_shards, shard_rows

MODEL_FILE = re.compile(r"^mp_rank_\d+_model_states\.pt$")
ZERO_FILE = re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")

Load = Callable[[str], object]
"""Reads one checkpoint file (path relative to the step directory) without running code."""


class ReshardError(ConfigError):
    """A checkpoint that cannot be re-sharded for this layout; one line saying why."""


@dataclass
class ParamState:
    """One parameter, whole (all TP shards joined, all DP partitions joined)."""

    weight: torch.Tensor | None = None
    """The saved parameter, in the engine's dtype."""
    master: torch.Tensor | None = None
    """fp32 master copy kept by the ZeRO / bf16 optimizer (None: a torch optimizer on the weights)."""
    optim: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-element optimizer state shaped like the weight (Adam: exp_avg, exp_avg_sq)."""
    step: torch.Tensor | None = None
    """The optimizer's step count for this parameter (None: the parameter had no optimizer state)."""


# ---- what a rank saved ------------------------------------------------------------------------
def optimizer_kind(optimizer) -> str | None:
    """``torch`` (per-parameter state), ``zero`` (ZeRO-1/2 flat partitions), ``bf16`` (DeepSpeed's
    bf16 optimizer), or None (a frozen engine)."""
    if optimizer is None:
        return None
    if hasattr(optimizer, "single_partition_of_fp32_groups"):
        return "zero"
    if hasattr(optimizer, "fp32_groups_flat_partition"):
        return "bf16"
    if isinstance(optimizer, torch.optim.Optimizer):
        return "torch"
    return type(optimizer).__name__  # recorded; refused if a resume has to re-shard it


def describe_rank(pm, optimizer, coords: tuple[int, int, int], sizes: tuple[int, int, int], files: list[str]) -> dict:
    """What this rank wrote, for the manifest: coordinates (stage, dp, tp), degrees (pp, dp, tp),
    layers, optimizer kind, files, and (DP index 0 only) the optimizer's parameter order and the
    TP split of each sharded parameter."""
    stage, dp, tp = coords
    kind = optimizer_kind(optimizer)
    rec = {"stage": stage, "dp": dp, "tp": tp, "pp_size": sizes[0], "dp_size": sizes[1], "tp_size": sizes[2],
           "layers": [pm._local_start, pm._local_stop], "optimizer": kind, "files": sorted(files)}
    if dp == 0:
        named = {id(p): n for n, p in pm.named_parameters()}
        if kind == "torch":
            rec["groups"] = [[named[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        rec["split"] = {n: [p.tp_dim, p.tp_pieces] for n, p in pm.named_parameters() if hasattr(p, "tp_dim")}
    return rec


def _signature(r: dict) -> tuple:
    return (r["stage"], r["dp"], r["tp"], r["pp_size"], r["dp_size"], r["tp_size"], tuple(r["layers"]), r["optimizer"])


def files_fit(saved: list[dict], mine: dict) -> bool:
    """Whether the module's saved engine files (``saved``: its ranks' records) are what this rank's
    engine (``mine``, its own record) would have written: then DeepSpeed's loader reads them as they are."""
    size = mine["pp_size"] * mine["dp_size"] * mine["tp_size"]
    return len(saved) == size and any(_signature(r) == _signature(mine) for r in saved)


# ---- joining shards (pure) --------------------------------------------------------------------
def join_tp(shards: list[torch.Tensor], split: list[int] | None) -> torch.Tensor:
    """The full tensor from every TP index's shard; ``split``: [dim, pieces] as TP cut it, None: replicated."""
    if split is None or len(shards) == 1:
        return shards[0]
    return merge_shards(shards, *split)


def cut_tp(full: torch.Tensor, split: list[int] | None, rank: int, size: int) -> torch.Tensor:
    """Inverse of ``join_tp``: TP index ``rank``'s shard of ``full`` (as ``shard_layer`` cuts it)."""
    if split is None or size == 1:
        return full
    dim, pieces = split
    return shard_rows(full, rank, size, pieces) if dim == 0 else full.chunk(size, dim=dim)[rank].contiguous()


def torch_optimizer_states(osd: dict, names: list[str]) -> dict[str, ParamState]:
    """Per-parameter state of a torch optimizer's ``state_dict`` (ids numbered in group order)."""
    ids = [i for g in osd["param_groups"] for i in g["params"]]
    if len(ids) != len(names):
        raise ReshardError(f"the optimizer state lists {len(ids)} parameters, the manifest {len(names)}")
    out = {}
    for i, name in zip(ids, names):
        s = osd["state"].get(i, {})
        out[name] = ParamState(optim={k: v for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0},
                               step=s.get("step"))
    return out


def zero_states(partitions: list[dict], shapes: dict[str, torch.Size]) -> dict[str, ParamState]:
    """Per-parameter fp32 masters and optimizer state from every DP rank's ZeRO / bf16 optimizer
    state (in DP order), cut out by DeepSpeed's ``param_slice_mappings``."""
    pieces: dict[str, dict[str, list]] = {}
    steps: dict[str, torch.Tensor] = {}
    for osd in partitions:
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            flat = osd["single_partition_of_fp32_groups"][g]
            state = osd["base_optimizer_state"]["state"].get(g, {})
            # DeepSpeed saves the fp32 partition without its alignment padding, the moments with it.
            tensors = {"master": flat, **{k: v for k, v in state.items()
                                          if torch.is_tensor(v) and v.dim() == 1 and v.numel() >= flat.numel()}}
            for name, addr in mapping.items():
                if name not in shapes:
                    continue  # a layer this rank does not hold now
                slot = pieces.setdefault(name, {})
                for key, t in tensors.items():
                    slot.setdefault(key, []).append(t.narrow(0, addr.start, addr.numel))
                if "step" in state:
                    steps[name] = state["step"]
    out = {}
    for name, keys in pieces.items():
        whole = {k: torch.cat(v).view(shapes[name]) for k, v in keys.items()}
        master = whole.pop("master")
        out[name] = ParamState(master=master, optim=whole, step=steps.get(name))
    return out


# ---- reading a module's shards ----------------------------------------------------------------
def read_module(module: str, files: list[str], records: list[dict], load: Load, layers: set[int]) -> dict[str, ParamState]:
    """Whole ``ParamState``s of the parameters (and buffers, weight only) of ``layers`` of ``module``,
    from the checkpoint files ``files`` (paths relative to the step directory) that ``records``
    (``describe_rank`` of every rank that saved the module) describe."""
    split = {n: s for r in records for n, s in r.get("split", {}).items()}
    # Weights: one file per (layer, TP index).
    by_layer: dict[int, dict[int, str]] = {}
    for f in files:
        head, _, base = f.rpartition("/")
        m = LAYER_FILE.match(base)
        if head == module and m and int(m.group(1)) in layers:
            by_layer.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
    if set(by_layer) != layers:
        raise ReshardError(f"{module}: no weights saved for layers {sorted(layers - set(by_layer))}")
    out: dict[str, ParamState] = {}
    shard_shapes: dict[int, dict[str, torch.Size]] = {}  # TP index -> name -> shard shape
    for idx, per_tp in sorted(by_layer.items()):
        states = [load(per_tp[t]) for t in sorted(per_tp)]
        for key in states[0]:
            name = f"{idx}.{key}"
            out[name] = ParamState(weight=join_tp([s[key] for s in states], split.get(name)))
            for t, s in zip(sorted(per_tp), states):
                shard_shapes.setdefault(t, {})[name] = s[key].shape
    # Optimizer state: per (stage, TP index) of the saving layout, from the stages holding these layers.
    cells: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        lo, hi = r["layers"]
        if r["optimizer"] is not None and any(lo <= i < hi for i in layers):
            cells.setdefault((r["stage"], r["tp"]), []).append(r)
    per_tp: dict[str, dict[int, ParamState]] = {}
    for (_, tp), recs in sorted(cells.items()):
        recs.sort(key=lambda r: r["dp"])
        kind = recs[0]["optimizer"]
        if kind not in ("torch", "zero", "bf16"):
            raise ReshardError(f"{module}: the optimizer {kind} of the saving run cannot be re-sharded")
        if kind == "torch":
            osd = load(_one(recs[0], MODEL_FILE, module))["optimizer"]
            names = [n for g in recs[0]["groups"] for n in g]
            found = torch_optimizer_states(osd, names)
        else:
            parts = [load(_one(r, ZERO_FILE, module))["optimizer_state_dict"] for r in recs]
            found = zero_states(parts, shard_shapes[tp])
        for name, st in found.items():
            per_tp.setdefault(name, {})[tp] = st
    for name, shards in per_tp.items():
        if name not in out:
            continue  # a parameter of another stage's layers, in a file read for ours
        ordered = [shards[t] for t in sorted(shards)]
        st, s = out[name], split.get(name)
        if ordered[0].master is not None:
            st.master = join_tp([x.master for x in ordered], s)
        st.optim = {k: join_tp([x.optim[k] for x in ordered], s) for k in ordered[0].optim}
        st.step = ordered[0].step
    return out


def tied_layers(ties: dict[str, str], layers: set[int]) -> set[int]:
    """``layers`` and the partner layer of every tie (``pm.tied_names``) one of them takes part in:
    a copy of a tied weight may find its optimizer state only with its partner."""
    out = set(layers)
    for follower, leader in ties.items():
        pair = {int(follower.split(".", 1)[0]), int(leader.split(".", 1)[0])}
        if pair & layers:
            out |= pair
    return out


def fill_tied(full: dict[str, ParamState], ties: dict[str, str]) -> None:
    """A tied weight saved as one parameter (its layers on one stage) has optimizer state under its
    leader's name only; the copy a stage of this layout holds alone takes it from there (and the
    other way round). Both copies are the same weight, so the states are the same."""
    for follower, leader in ties.items():
        a, b = full.get(follower), full.get(leader)
        if a is None or b is None:
            continue
        src, dst = (b, a) if a.step is None else (a, b)
        if dst.step is None and src.step is not None:
            dst.master, dst.optim, dst.step = src.master, dict(src.optim), src.step


def _one(rec: dict, pattern: re.Pattern, module: str) -> str:
    found = [f for f in rec["files"] if pattern.match(f.rpartition("/")[2])]
    if len(found) != 1:
        raise ReshardError(f"{module}: stage {rec['stage']} dp {rec['dp']} tp {rec['tp']} saved {len(found)} "
                           f"files named like {pattern.pattern}, expected 1")
    return found[0]


def scheduler_state(module: str, records: list[dict], load: Load) -> dict | None:
    """The engine bookkeeping of the saving run (LR scheduler, global steps and samples), from its
    first stage's model-state file; None for a frozen module."""
    first = [r for r in records if r["stage"] == 0 and r["dp"] == 0 and r["tp"] == 0 and r["optimizer"]]
    if not first:
        return None
    sd = load(_one(first[0], MODEL_FILE, module))
    return {k: sd.get(k) for k in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")}


# ---- loading into this rank's engine ------------------------------------------------------------
def _split_of(p) -> list[int] | None:
    return [p.tp_dim, p.tp_pieces] if hasattr(p, "tp_dim") else None


def load_into_engine(engine, pm, full: dict[str, ParamState], tp_rank: int, tp_size: int) -> list[str]:
    """Write this rank's shards of ``full`` into ``pm``'s parameters and buffers and the engine's
    optimizer; returns what was set (for the resume line)."""
    named = dict(pm.named_parameters())
    missing = sorted(set(named) - set(full))
    if missing:
        raise ReshardError(f"the checkpoint holds no value for parameter {missing[0]} ({len(missing)} missing)")
    mine = {n: (p, cut_tp(full[n].weight, _split_of(p), tp_rank, tp_size)) for n, p in named.items()}
    with torch.no_grad():
        for n, (p, w) in mine.items():
            _check_shape(n, w, p)
            p.data.copy_(w)
        for n, b in pm.named_buffers():
            if n in full and full[n].weight is not None and full[n].weight.shape == b.shape:
                b.copy_(full[n].weight)
    done = ["weights"]
    opt, kind = engine.optimizer, optimizer_kind(engine.optimizer)
    trained = [n for n, p in named.items() if p.requires_grad]
    if kind is None or not trained:
        return done
    stateless = _stateless(opt if kind == "torch" else getattr(opt, "optimizer", opt))
    lacking = [] if stateless else [n for n in trained if full[n].step is None]
    if lacking:
        raise ReshardError(f"the checkpoint holds no optimizer state for parameter {lacking[0]} (frozen when saved?)")
    cut = {n: {k: cut_tp(v, _split_of(named[n]), tp_rank, tp_size) for k, v in full[n].optim.items()} for n in trained}
    if kind == "torch":
        ids = {id(p): n for n, p in named.items()}
        for g in opt.param_groups:
            for p in g["params"]:
                n = ids[id(p)]
                moments = {k: v.to(device=p.device, dtype=p.dtype, copy=True) for k, v in cut[n].items()}
                if not stateless:
                    opt.state[p] = {"step": full[n].step.detach().clone(), **moments}
        done.append("optimizer state (none: SGD without momentum keeps none)" if stateless else
                    "optimizer state (" + ", ".join(sorted({k for v in cut.values() for k in v} | {"step"})) + ")")
        return done
    flats = opt.single_partition_of_fp32_groups if kind == "zero" else opt.fp32_groups_flat_partition
    bufs = [{} for _ in flats]
    steps: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for n in trained:
            p, m = named[n], getattr(named[n], "_hp_mapping", None)
            if m is None:
                continue  # no fragment of this parameter in this DP rank's partition
            g, lp, hp = m.param_group_index, m.lp_fragment_address, m.hp_fragment_address
            master = full[n].master if full[n].master is not None else full[n].weight
            src = cut_tp(master, _split_of(p), tp_rank, tp_size).float().flatten()
            m.hp_fragment.data.copy_(src.narrow(0, lp.start, lp.numel))
            for k, v in cut[n].items():
                buf = bufs[g].setdefault(k, torch.zeros_like(flats[g]))
                buf.narrow(0, hp.start, hp.numel).copy_(v.float().flatten().narrow(0, lp.start, lp.numel))
            if full[n].step is not None:
                steps[g] = full[n].step
    for g, flat in enumerate(flats):
        if g in steps:
            opt.optimizer.state[flat] = {"step": steps[g].detach().clone(), **bufs[g]}
    keys = sorted({k for b in bufs for k in b} | {"step"})
    done.append(f"fp32 master partitions and optimizer state ({', '.join(keys)}) over {opt.partition_count[0]} DP ranks"
                if kind == "zero" else f"fp32 master partitions and optimizer state ({', '.join(keys)})")
    return done


def _stateless(optimizer) -> bool:
    """A torch SGD without momentum: it keeps no per-parameter state, so a checkpoint has none to load."""
    return isinstance(optimizer, torch.optim.SGD) and all(not g.get("momentum") for g in optimizer.param_groups)


def _check_shape(name: str, value: torch.Tensor, p) -> None:
    if value.shape != p.shape:
        raise ReshardError(f"parameter {name}: the checkpoint's shard is {tuple(value.shape)}, this layout needs {tuple(p.shape)}")


def restore_schedule(engine, saved: dict | None) -> None:
    """Continue the LR schedule and DeepSpeed's step counters where the saving run stopped."""
    if saved is None or engine.optimizer is None:
        return
    sched, s = engine.lr_scheduler, saved["lr_scheduler"] or {}
    if sched is not None and "last_epoch" in s:
        sched.last_epoch, sched._step_count = s["last_epoch"], s.get("_step_count", s["last_epoch"] + 1)
        lrs = [base * lam(sched.last_epoch) for base, lam in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(sched.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs
    engine.global_steps = int(saved["global_steps"] or 0)
    engine.global_samples = int(saved["global_samples"] or 0)
    engine.skipped_steps = int(saved["skipped_steps"] or 0)
