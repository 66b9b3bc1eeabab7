"""Fuzzing the recipe loader: over 400 malformed recipes, DeepSpeed JSONs and overrides.

Each case is generated (seeded) from the shipped recipes and written to a temporary folder. Every
one must be refused by ``load_recipe`` (or ``Topology.check_world``) with a ``ConfigError`` whose
message is one line naming the file (or "command line") and the offending key; any other
exception fails. No file is changed by an attempt. A few cases also go through ``tools/train.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import random
import subprocess
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from disttrain_ds.configtools import from_dict
from disttrain_ds.errors import ConfigError
from disttrain_ds.recipe.graph import expand_graph_sections, link_sections, topology_of
from disttrain_ds.recipe.schema import ModuleParallel, Recipe, _apply_presets, load_recipe, validate

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "recipes").glob("*.yaml"))}
BASES = {name: data for name, data in SHIPPED.items() if "modules" not in data["model"]}
"""Recipes in the three-module form: the schema-driven cases write its keys (model.encoder ...)."""
TMP = "@TMP@"
"""Placeholder for the case's temporary folder in recipe values, overrides and file names."""
CLI = "command line"
ENV = "environment"


@dataclass(frozen=True)
class Case:
    """One malformed input and what its error must say."""

    id: str
    recipe: object
    """A mapping (written as YAML) or raw bytes (written as they are)."""
    words: tuple[str, ...]
    """Substrings the message must contain (the offending key, quoted, where there is one)."""
    names: str = "recipe.yaml"
    """The file the message must name, relative to the temporary folder; or "command line", "environment"."""
    overrides: tuple[str, ...] = ()
    files: tuple[tuple[str, bytes], ...] = ()
    """Extra files (DeepSpeed JSONs, folders' contents) written beside the recipe."""
    world: int | None = None
    """Check the recipe's rank map against this world size (the recipe itself is valid)."""


# ----------------------------------------------------------------------------- generation helpers


def schema(cls=Recipe, prefix: str = ""):
    """(dotted key, annotation, is_section) of every field of the recipe, depth first."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        optional = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(optional) == 1:
            tp = optional[0]  # an optional section (None only after loading, in the graph form)
        if tp is typing.Any and f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()  # a section typed by its family (model.encoder: the default family's)
            tp = type(made) if dataclasses.is_dataclass(made) else tp
        if dataclasses.is_dataclass(tp):
            yield key, tp, True
            yield from schema(tp, key + ".")
        else:
            yield key, tp, False


def set_key(data: dict, key: str, value) -> dict:
    """A copy of ``data`` with the dotted ``key`` set (missing sections are created)."""
    out = copy.deepcopy(data)
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def with_keys(data: dict, **dotted) -> dict:
    for k, v in dotted.items():
        data = set_key(data, k.replace("__", "."), v)
    return data


def wrong_values(tp) -> list:
    """Values of the wrong type for annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return ["bogus_choice", 3, [args[0]], None, {"x": args[0]}, True]
    if origin in (list, tuple):
        bad_item = "x" if args[0] in (int, float) else 7
        return ["not-a-list", 5, {"a": 1}, None, [bad_item], [[1]], True]
    if tp is bool:
        return [1, "maybe", [True], None, {"a": True}, 0.5, "yes"]
    if tp is int:
        return ["three", 2.5, [1], {"a": 1}, True, None, "1e3"]
    if tp is float:
        return ["fast", [0.5], {"a": 1.0}, True, None, "1e-3", float("nan")]
    if tp is str:
        return [5, 1.5, ["a"], {"a": "b"}, True, None]
    if origin is dict:
        return ["not-a-mapping", 5, [1], True]
    if origin in (typing.Union, types.UnionType) and set(args) - {int} and all(
            a is int or typing.get_origin(a) is typing.Literal for a in args):  # a count or a named choice
        return ["three", 2.5, [1], {"a": 1}, True, None, "bogus_choice"]
    if origin in (typing.Union, types.UnionType) and bool in args and all(
            a is bool or typing.get_origin(a) is typing.Literal for a in args):  # a switch or a named choice
        return [1, "maybe", [True], None, {"a": True}, 0.5, "bogus_choice"]
    raise AssertionError(f"no wrong values for {tp}")


def typo(rng: random.Random, key: str, known: set[str]) -> str:
    """A plausible misspelling of ``key`` that is not a real key."""
    for _ in range(50):
        i = rng.randrange(len(key))
        kind = rng.randrange(6)
        if kind == 0 and len(key) > 1:
            j = min(i, len(key) - 2)
            out = key[:j] + key[j + 1] + key[j] + key[j + 2:]
        elif kind == 1 and len(key) > 2:
            out = key[:i] + key[i + 1:]
        elif kind == 2:
            out = key[:i] + key[i] + key[i:]
        elif kind == 3:
            out = key + "s"
        elif kind == 4:
            out = key.replace("_", "-") if "_" in key else key.capitalize()
        else:
            out = key[:i] + rng.choice("aeiouxz") + key[i + 1:]
        if out not in known:
            return out
    raise AssertionError(f"no typo for {key}")


def in_memory(recipe: dict) -> Recipe:
    """``recipe`` parsed and validated without a file (for the generator's own starting points)."""
    r = from_dict(Recipe, _apply_presets(expand_graph_sections(copy.deepcopy(recipe), "<mem>"), "<mem>"), src="<mem>")
    link_sections(r, ModuleParallel)
    validate(r)
    return r


def valid(recipe: dict) -> bool:
    try:
        in_memory(recipe)
    except ConfigError:
        return False
    return True


# ----------------------------------------------------------------------------- the cases


def unknown_key_cases(rng: random.Random) -> list[Case]:
    sections = [("", Recipe)] + [(k, tp) for k, tp, sec in schema() if sec]
    out = []
    for key, tp in sections:
        known = {f.name for f in dataclasses.fields(tp)}
        for n in range(3):
            base_name = rng.choice(sorted(BASES))
            bad = typo(rng, rng.choice(sorted(known)), known)
            full = f"{key}.{bad}" if key else bad
            out.append(Case(f"unknown-{full}-{n}", set_key(BASES[base_name], full, 1), (f"unknown key '{full}'",)))
    tiny = BASES["tiny_cpu.yaml"]
    for key, label in [("train", "None"), ("model.llm", "True"), ("data", "7"), ("", "2.5")]:
        weird = {"None": None, "True": True, "7": 7, "2.5": 2.5}[label]
        data = copy.deepcopy(tiny)
        node = data
        for part in filter(None, key.split(".")):
            node = node[part]
        node[weird] = "x"  # a key that is not even a string, beside string keys
        full = f"{key}.{label}" if key else label
        out.append(Case(f"unknown-nonstring-{full}", data, (f"unknown key '{full}'",)))
    return out


def wrong_type_cases(rng: random.Random) -> list[Case]:
    out = []
    for key, tp, section in schema():
        if section:
            values = rng.sample(["a string", [1, 2], 3, True], 2)
        else:
            values = rng.sample(wrong_values(tp), 2)
        for value in values:
            base_name = rng.choice(sorted(BASES))
            out.append(Case(f"type-{key}-{value!r}", set_key(BASES[base_name], key, value), (f"'{key}",)))
    return out


RANGE = [  # (dotted overrides applied to tiny_cpu, key named in the message)
    ({"train.steps": -1}, "train.steps"),
    ({"train.steps": 0}, "train.steps"),
    ({"train.global_batch": 0}, "train.global_batch"),
    ({"train.global_batch": -4}, "train.global_batch"),
    ({"train.micro_batch": 0}, "train.micro_batch"),
    ({"train.global_batch": 5, "train.micro_batch": 2}, "train.global_batch"),
    ({"train.global_batch": 6, "parallel.llm.dp": 4}, "train.global_batch"),
    ({"train.peak_tflops": -1.0}, "train.peak_tflops"),
    ({"train.resume": ""}, "train.resume"),
    ({"parallel.llm.tp": 3}, "parallel.llm.tp"),
    ({"parallel.encoder.tp": 0}, "parallel.encoder.tp"),
    ({"parallel.generator.tp": 16}, "parallel.generator.tp"),
    ({"parallel.llm.pp": 0}, "parallel.llm.pp"),
    ({"parallel.llm.pp": 7}, "parallel.llm.pp"),  # tiny LLM: 4 layers + embedding + head
    ({"parallel.encoder.pp": 6}, "parallel.encoder.pp"),  # tiny ViT: 2 blocks + embed + head + projector
    ({"parallel.generator.pp": 9}, "parallel.generator.pp"),  # tiny U-Net: 8 pipeline layers
    ({"parallel.llm.dp": 0}, "parallel.llm.dp"),
    ({"parallel.encoder.dp": -1}, "parallel.encoder.dp"),
    ({"layout": "disaggregated", "parallel.encoder.dp": 3}, "parallel.encoder.dp"),
    ({"layout": "disaggregated", "parallel.generator.dp": 8}, "parallel.generator.dp"),
    ({"parallel.llm.partition": "random"}, "parallel.llm.partition"),
    ({"layout": "monolithic", "parallel.post_balance": True}, "parallel.post_balance"),
    ({"parallel.post_balance_share": 0.5}, "parallel.post_balance_share"),
    ({"parallel.comm_timeout_s": 0}, "parallel.comm_timeout_s"),
    ({"parallel.heartbeat_timeout_s": -1}, "parallel.heartbeat_timeout_s"),
    ({"optim.lr": 0}, "optim.lr"),
    ({"optim.lr": -0.1}, "optim.lr"),
    ({"optim.lr": float("inf")}, "optim.lr"),
    ({"optim.lr": 10**400}, "optim.lr"),
    ({"optim.betas": [0.9]}, "optim.betas"),
    ({"optim.betas": [0.9, 0.95, 0.99]}, "optim.betas"),
    ({"optim.betas": [0.9, 1.5]}, "optim.betas"),
    ({"optim.eps": 0}, "optim.eps"),
    ({"optim.weight_decay": -0.1}, "optim.weight_decay"),
    ({"optim.warmup_steps": -3}, "optim.warmup_steps"),
    ({"optim.grad_clip": -1.0}, "optim.grad_clip"),
    ({"logging.every": 0}, "logging.every"),
    ({"checkpoint.every": -1}, "checkpoint.every"),
    ({"checkpoint.keep": -2}, "checkpoint.keep"),
    ({"checkpoint.every": 5}, "checkpoint.every"),  # the reference layout writes no checkpoints
    ({"seed": -1}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"model.gen_loss_weight": -1.0}, "model.gen_loss_weight"),
    ({"model.encoder.patch_size": 0}, "model.encoder.patch_size"),
    ({"model.encoder.layers": -2}, "model.encoder.layers"),
    ({"model.encoder.heads": 3}, "model.encoder.heads"),  # 32 is not divisible by 3
    ({"model.llm.hidden_size": 0}, "model.llm.hidden_size"),
    ({"model.llm.kv_heads": 3}, "model.llm.kv_heads"),
    ({"model.llm.vocab_size": -1}, "model.llm.vocab_size"),
    ({"model.llm.rope_theta": 0.0}, "model.llm.rope_theta"),
    ({"model.generator.block_out_channels": [16, 32, 64]}, "model.generator.down_block_types"),
    ({"model.generator.norm_num_groups": 5}, "model.generator.norm_num_groups"),
    ({"model.generator.resolution": 15}, "model.generator.resolution"),
    ({"model.generator.query_tokens": 0}, "model.generator.query_tokens"),
    ({"model.encoder.frozen": True, "model.encoder.projector.frozen": True, "model.llm.frozen": True,
      "model.generator.frozen": True, "model.generator.projector.frozen": True}, "model"),
    ({"layout": "disaggregated", "parallel.encoder.pp": 2, "model.encoder.frozen": True}, "parallel.encoder.pp"),
    ({"model.llm.preset": "gpt-5"}, "model.llm.preset"),
    ({"layout": "pipeline"}, "layout"),
    ({"data.seq_len": 8}, "data.seq_len"),
    ({"data.image_sizes": [15]}, "data.image_sizes"),
    ({"data.image_sizes": [0]}, "data.image_sizes"),
    ({"data.image_sizes": []}, "data.image_sizes"),
    ({"data.source": "imagenet"}, "data.source"),
    ({"data.source": "local"}, "data.path"),  # the record sources need a path: no default data
    ({"data.source": "mmc4"}, "data.path"),
    ({"data.source": "laion"}, "data.path"),
    ({"data.gen_images": [2, 1]}, "data.gen_images"),
    ({"data.gen_images": [1]}, "data.gen_images"),
    ({"data.gen_images": [-1, 1]}, "data.gen_images"),
    ({"data.gen_images": [30, 30]}, "data.gen_images"),  # 30 query runs do not fit 128 tokens
    ({"data.text_tokens": [48, 8]}, "data.text_tokens"),
    ({"data.text_tokens": [8, 16, 32]}, "data.text_tokens"),
    ({"data.max_images": -1}, "data.max_images"),
    ({"data.max_images": 0}, "data.max_images"),  # the synthetic source draws 1..max_images
    ({"data.gen_prob": 1.5}, "data.gen_prob"),
    ({"data.producers": -1}, "data.producers"),
    ({"data.queue_depth": 0}, "data.queue_depth"),
    ({"data.resolution_sampler": "random"}, "data.resolution_sampler"),
    ({"data.share": "host"}, "data.share"),
    ({"data.spool_dir": "/no/such/dir"}, "data.spool_dir"),
    # Real images give RGB targets: a latent-space (4-channel) U-Net cannot train on them.
    ({"data.source": "laion", "data.path": f"{TMP}/captions.jsonl", "model.generator.in_channels": 4},
     "model.generator.in_channels"),
    ({"emulate.time_scale": -1.0}, "emulate.time_scale"),
    ({"emulate.calibration_batches": 0}, "emulate.calibration_batches"),
]


def range_cases() -> list[Case]:
    tiny = BASES["tiny_cpu.yaml"]
    captions = (("captions.jsonl", b'{"caption": "a cat on a mat"}\n'),)
    return [Case(f"range-{key}-{i}", with_keys(tiny, **{k.replace(".", "__"): v for k, v in sets.items()}), (f"'{key}'",),
                 files=captions if sets.get("data.path") else ())
            for i, (sets, key) in enumerate(RANGE)]


def world_cases(rng: random.Random) -> list[Case]:
    """Valid layouts checked against world sizes their ranks do not tile."""
    out: list[Case] = []
    tiny = BASES["tiny_cpu.yaml"]
    seen = set()
    while len(out) < 30:
        layout = rng.choice(["disaggregated", "monolithic"])
        deg = {f"parallel.{m}.{a}": rng.choice([1, 2] if a == "dp" else [1, 2, 3]) for m in ("encoder", "llm", "generator")
               for a in ("dp", "pp")}
        recipe = with_keys(tiny, layout=layout, train__global_batch=4, **{k.replace(".", "__"): v for k, v in deg.items()})
        key = (layout, tuple(sorted(deg.items())))
        if key in seen or not valid(recipe):
            continue
        seen.add(key)
        need = topology_of(in_memory(recipe)).world_size
        world = rng.choice([w for w in (need - 1, need + 1, 2 * need, 1, 0) if w != need])
        out.append(Case(f"world-{layout}-{need}-vs-{world}", recipe, ("'parallel'", f"needs {need} ranks", f"has {world}"),
                        world=world))
    out.append(Case("world-reference-has-no-rank-map", tiny, ("'layout'", "reference"), world=1))
    return out


def missing_file_cases() -> list[Case]:
    tiny = BASES["tiny_cpu.yaml"]
    gone = f"{TMP}/no/such"
    cases = [
        ("model.encoder.checkpoint", f"{gone}/vit.safetensors", {}),
        ("model.llm.checkpoint", f"{gone}/llama", {}),
        ("model.generator.checkpoint", f"{gone}/unet.safetensors", {}),
        ("deepspeed_config", f"{gone}/ds.json", {}),
        ("deepspeed_config", f"{TMP}", {}),  # a folder, not a file
        ("parallel.llm.ds_config", f"{gone}/llm.json", {}),
        ("parallel.generator.ds_config", "ds_configs/not_shipped.json", {}),
        ("train.resume", f"{gone}/step_00000010", {"layout": "disaggregated"}),
        ("data.path", f"{gone}/records.jsonl", {"data.source": "local"}),
        ("data.path", f"{gone}/mmc4.jsonl", {"data.source": "mmc4"}),
        ("data.path", f"{gone}/laion", {"data.source": "laion"}),
        ("data.path", f"{TMP}/empty_dir", {"data.source": "local"}),
        ("data.tokenizer", f"{gone}/tokenizer", {}),
        ("emulate.profile", f"{gone}/profile.json", {"layout": "disaggregated", "emulate.enabled": True}),
    ]
    out = []
    for i, (key, value, extra) in enumerate(cases):
        recipe = with_keys(tiny, **{k.replace(".", "__"): v for k, v in {**extra, key: value}.items()})
        files = (("empty_dir/notes.txt", b"not a record file\n"),) if value.endswith("empty_dir") else ()
        out.append(Case(f"missing-{key}-{i}", recipe, (f"'{key}'",), files=files))
    return out


DS_BAD = [  # (JSON bytes, words)
    (b'{"zero_optimization": {"stage": 0},}', ("invalid JSON", "line 1")),
    (b'{"zero_optimisation": {"stage": 1}}', ("'zero_optimisation'",)),
    (b'{"fp17": {}}', ("'fp17'",)),
    (b'{"train_batch_size": 8}', ("'train_batch_size'",)),
    (b'{"optimizer": {"type": "Adam"}}', ("'optimizer'",)),
    (b'{"gradient_accumulation_steps": 2}', ("'gradient_accumulation_steps'",)),
    (b'{"zero_optimization": 1}', ("'zero_optimization'",)),
    (b'{"zero_optimization": {"stage": "1"}}', ("'zero_optimization.stage'",)),
    (b'{"zero_optimization": {"stage": true}}', ("'zero_optimization.stage'",)),
    (b'{"zero_optimization": {"stage": 3}}', ("'zero_optimization.stage'",)),
    (b'{"zero_optimization": {"stage": "0\\n1"}}', ("'zero_optimization.stage'",)),
    (b'{"bf16": []}', ("'bf16'",)),
    (b'{"fp16": "yes"}', ("'fp16'",)),
    (b'{"fp16": {"enabled": true}}', ("'fp16'",)),
    (b'{"bf16": {"enabled": true}}', ("'bf16.enabled'",)),
    (b'{"steps_per_print": "often"}', ("'steps_per_print'",)),
    (b'{"wall_clock_breakdown": "no"}', ("'wall_clock_breakdown'",)),
    (b'{"gradient_clipping": "1.0"}', ("'gradient_clipping'",)),
    (b'{"pipeline": 5}', ("'pipeline'",)),
    (b'{"checkpoint": ["tag"]}', ("'checkpoint'",)),
    (b'{"activation_checkpointing": null}', ("'activation_checkpointing'",)),
    (b'{"zero_optimization": {"stage": 1}, "zero_optimization": {"stage": 0}}', ("duplicate key 'zero_optimization'",)),
    (b"\xff\xfe{\x00}\x00", ("UTF-8",)),
    (b'{"wandb": {"project": "caf\xe9"}}', ("UTF-8",)),
    (b"", ("invalid JSON",)),
    (b"   \n", ("invalid JSON",)),
    (b"[1, 2]", ("top level",)),
    (b'"zero"', ("top level",)),
    (b"null", ("top level",)),
    (b"[" * 100000 + b"]" * 100000, ("nested too deeply",)),
]


def ds_cases() -> list[Case]:
    tiny = BASES["tiny_cpu.yaml"]
    out = []
    for i, (content, words) in enumerate(DS_BAD):
        key = ["deepspeed_config", *(f"parallel.{m}.ds_config" for m in ("encoder", "llm", "generator"))][i % 4]
        recipe = set_key(tiny, key, f"{TMP}/ds.json")
        out.append(Case(f"ds-{i}", recipe, words, names="ds.json", files=(("ds.json", content),)))
    return out


YAML_BAD = [  # (recipe bytes, words)
    (b"train: [unclosed\n", ("invalid YAML", "line")),
    (b"train:\n  steps: 3\n   micro_batch: 1\n", ("invalid YAML", "line 3")),
    (b"train:\n\tsteps: 3\n", ("invalid YAML", "line 2")),
    (b"name: 'unterminated\n", ("invalid YAML",)),
    (b"name: [a, b]]\n", ("invalid YAML",)),
    (b"{\n", ("invalid YAML",)),
    (b"---\nname: a\n---\nname: b\n", ("invalid YAML",)),
    (b"name: !!python/object/apply:os.system [echo]\n", ("invalid YAML",)),
    (b"name: x\x00y\n", ("invalid YAML",)),
    (b"? [a, b]\n: 1\n", ("invalid YAML",)),
    (b"- just\n- a list\n", ("top level must be a mapping",)),
    (b"42\n", ("top level must be a mapping",)),
    (b"just a string\n", ("top level must be a mapping",)),
    (b"\xff\xfen\x00a\x00m\x00e\x00", ("UTF-8",)),
    (b"name: caf\xe9\n", ("UTF-8",)),
    (b"train:\n  steps: 3\ntrain:\n  steps: 5\n", ("duplicate key 'train'", "line 3")),
    (b"train: {steps: 3, steps: 4}\n", ("duplicate key 'steps'",)),
    (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", ("nested too deeply",)),
    (b"seed: " + b"7" * 5000 + b"\n", ("invalid YAML", "line 1")),
    (b"data:\n  image_sizes: &a [*a]\n", ("'data.image_sizes[0]'",)),
    (b"name: &a [*a]\n", ("'name'",)),
    (b"name: 2024-01-01\n", ("'name'",)),
    (b"logging:\n  dir: !!binary aGVsbG8=\n", ("'logging.dir'",)),
    (b"train:\n  resume: \"line one\\nline two\"\nlayout: disaggregated\n", ("'train.resume'",)),
]


def yaml_cases() -> list[Case]:
    return [Case(f"yaml-{i}", content, words) for i, (content, words) in enumerate(YAML_BAD)]


OVERRIDES_BAD = [  # (override, words, file named)
    ("train.steps", ("'train.steps'", "key=value"), CLI),
    (".x=1", ("'.x=1'",), CLI),
    ("train..steps=1", ("'train..steps=1'",), CLI),
    ("=5", ("'=5'",), CLI),
    (" =1", ("' =1'",), CLI),
    ("train.=3", ("'train.=3'",), CLI),
    ("train.steps.deep=1", ("'train.steps.deep'", "'steps'"), CLI),
    ("name.first=x", ("'name.first'", "'name'"), CLI),
    ("data.image_sizes.0=16", ("'data.image_sizes.0'", "'image_sizes'"), CLI),
    ("model.encoder.preset.size=1", ("'model.encoder.preset.size'", "'preset'"), CLI),
    ("train.stepz=3", ("unknown key 'train.stepz'",), "recipe.yaml"),
    ("train=5", ("'train'",), "recipe.yaml"),
    ("model.encoder=[1]", ("'model.encoder'",), "recipe.yaml"),
    ("train.steps=[1", ("'train.steps'",), "recipe.yaml"),
    ("train.steps=", ("'train.steps'",), "recipe.yaml"),
    ("seed=" + "7" * 5000, ("'seed'",), "recipe.yaml"),  # too long for int(): kept as text, then refused
    ("train.steps=" + "[" * 5000 + "]" * 5000, ("'train.steps'",), "recipe.yaml"),
    ("train.steps={a: 1, a: 2}", ("'train.steps'",), "recipe.yaml"),
]


def override_cases() -> list[Case]:
    out = []
    tiny = BASES["tiny_cpu.yaml"]
    for i, (text, words, names) in enumerate(OVERRIDES_BAD):
        out.append(Case(f"override-{i}", tiny, words, names=names, overrides=(text,)))
    return out


def all_cases() -> list[Case]:
    rng = random.Random(20240811)
    cases = (unknown_key_cases(rng) + wrong_type_cases(rng) + range_cases() + world_cases(rng)
             + missing_file_cases() + ds_cases() + yaml_cases() + override_cases())
    seen: dict[str, int] = {}
    for i, c in enumerate(cases):  # a repeated draw keeps its own test id
        seen[c.id] = seen.get(c.id, 0) + 1
        if seen[c.id] > 1:
            cases[i] = dataclasses.replace(c, id=f"{c.id}#{seen[c.id]}")
    return cases


CASES = all_cases()


# ----------------------------------------------------------------------------- running a case


def fill(value, tmp: Path):
    """``value`` with the temporary-folder placeholder replaced."""
    if isinstance(value, str):
        return value.replace(TMP, str(tmp))
    if isinstance(value, dict):
        return {k: fill(v, tmp) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, tmp) for v in value]
    return value


def write_case(case: Case, tmp: Path) -> Path:
    for name, content in case.files:
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
    path = tmp / "recipe.yaml"
    if isinstance(case.recipe, bytes):
        path.write_bytes(case.recipe)
    else:
        path.write_text(yaml.safe_dump(fill(case.recipe, tmp), sort_keys=False))
    return path


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (plus the shipped recipes and DeepSpeed JSONs)."""
    out = {}
    for root in (*roots, REPO / "recipes", REPO / "ds_configs"):
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def attempt(case: Case, path: Path, tmp: Path) -> None:
    recipe = load_recipe(path, [fill(o, tmp) for o in case.overrides])
    if case.world is None:
        raise AssertionError(f"{case.id}: load_recipe accepted a malformed recipe")
    topology_of(recipe).check_world(case.world, recipe.source_file)
    raise AssertionError(f"{case.id}: check_world accepted world size {case.world}")


def assert_one_line(msg: str, case: Case, tmp: Path) -> None:
    assert len(msg.splitlines()) == 1 and msg.strip(), f"{case.id}: not one line: {msg!r}"
    named = case.names if case.names in (CLI, ENV) else str(tmp / case.names)
    assert named in msg, f"{case.id}: message does not name {named}: {msg}"
    for w in case.words:
        assert w in msg, f"{case.id}: message lacks {w!r}: {msg}"


def test_fuzz_generates_over_200_distinct_malformed_recipes():
    kinds = {c.id.split("-")[0] for c in CASES}
    assert len(CASES) >= 200 and kinds == {"unknown", "type", "range", "world", "missing", "ds", "yaml", "override"}
    leaves = [k for k, _, sec in schema() if not sec]
    assert {c.id.split("-")[1] for c in CASES if c.id.startswith("type-")} >= set(leaves)  # every leaf field


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_malformed_recipe_is_refused_with_one_line_naming_file_and_key(case, tmp_path):
    path = write_case(case, tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as err:
        attempt(case, path, tmp_path)
    assert_one_line(str(err.value), case, tmp_path)
    assert snapshot(tmp_path) == before, f"{case.id}: files changed"


# ----------------------------------------------------------------------------- the real command line

CLI_CASES = [  # (case id, extra environment)
    ("unknown-train.stepz", {}),
    ("type-train.steps", {}),
    ("range-parallel.llm.tp", {}),
    ("ds-1", {}),
    ("yaml-0", {}),
    ("yaml-14", {}),
    ("yaml-17", {}),
    ("override-0", {}),
    ("missing-model.llm.checkpoint", {}),
    ("range-data.source", {}),
    ("world-disaggregated", {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}),
    ("world-reference", {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}),
    ("world-not-a-number", {"WORLD_SIZE": "four", "RANK": "0"}),
]


def cli_case(prefix: str) -> Case:
    tiny = BASES["tiny_cpu.yaml"]
    if prefix == "unknown-train.stepz":
        return Case(prefix, set_key(tiny, "train.stepz", 3), ("unknown key 'train.stepz'",))
    if prefix == "type-train.steps":
        return Case(prefix, set_key(tiny, "train.steps", "many"), ("'train.steps'",))
    if prefix == "world-disaggregated":  # the rank map is checked before any process group starts
        return Case(prefix, set_key(tiny, "layout", "disaggregated"), ("'parallel'", "needs 4 ranks", "has 3"))
    if prefix == "world-reference":
        return Case(prefix, tiny, ("'layout'", "2"))
    if prefix == "world-not-a-number":
        return Case(prefix, tiny, ("'WORLD_SIZE'", "'four'"), names=ENV)
    return next(c for c in CASES if c.id.startswith(prefix))


def test_command_line_prints_one_line_and_exits_2_for_malformed_recipes(tmp_path):
    env_base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env_base.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    started = []
    for i, (prefix, env) in enumerate(CLI_CASES):  # all at once: each spends its time importing
        case = cli_case(prefix)
        tmp = tmp_path / f"case{i}"
        cwd = tmp / "cwd"  # where a run directory would appear
        cwd.mkdir(parents=True)
        path = write_case(case, tmp)
        before = snapshot(tmp)
        cmd = [sys.executable, str(REPO / "tools" / "train.py"), "--recipe", str(path),
               *[fill(o, tmp) for o in case.overrides]]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env={**env_base, **env})
        started.append((prefix, case, tmp, cwd, before, proc))
    for prefix, case, tmp, cwd, before, proc in started:
        stdout, stderr = proc.communicate(timeout=240)
        lines = stderr.splitlines()
        assert proc.returncode == 2, f"{prefix}: exit {proc.returncode}: {stderr[-2000:]}"
        assert len(lines) == 1 and lines[0].strip(), f"{prefix}: stderr is not one line: {stderr[-2000:]}"
        assert "Traceback" not in stderr + stdout
        assert_one_line(lines[0].removeprefix("error: "), case, tmp)
        assert snapshot(tmp) == before and not any(cwd.iterdir()), f"{prefix}: files written or changed"
