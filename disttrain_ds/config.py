"""Recipe schema: one YAML file (plus ``a.b=c`` overrides) describes a whole training job.

``load_recipe`` validates everything that can be checked before any process group starts and
raises ``ConfigError`` with one line naming the key and the file. A recipe is a YAML path or the
name of one shipped with the package (``tiny_cpu`` is ``disttrain_ds/recipes/tiny_cpu.yaml``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .configtools import ConfigError, apply_overrides, from_dict, load_yaml
from .data.config import DataConfig
from .families import DEFAULT_FAMILY, get_family
from .models.configs import EncoderConfig, GeneratorConfig, LLMConfig, trains
from .recipe_graph import (
    expand_graph_sections,
    graph_of,
    link_sections,
    module_config,
    module_family,
    module_key,
    module_parallel,
    parallel_key,
)

PACKAGE_DIR = Path(__file__).resolve().parent
"""The package, with its shipped ``recipes/*.yaml`` and ``ds_configs/*.json``."""
RECIPES_DIR = PACKAGE_DIR / "recipes"
"""Shipped recipes, found by name (``--recipe tiny_cpu``)."""


@dataclass
class ModelConfig:
    """The modules and how their losses combine: the three-module form (``encoder``, ``llm``,
    ``generator``) or a module graph (``modules``); see ``recipe_graph.py``."""

    encoder: EncoderConfig | None = field(default_factory=EncoderConfig)
    """Three-module form: the image encoder (ViT + input projector). With ``modules``: the only
    encoder, if there is exactly one (else None)."""
    llm: LLMConfig | None = field(default_factory=LLMConfig)
    """Three-module form: the LLM backbone. With ``modules``: the LLM."""
    generator: GeneratorConfig | None = field(default_factory=GeneratorConfig)
    """Three-module form: the image generator (output projector + diffusion U-Net). With
    ``modules``: the only generator, if there is exactly one (else None)."""
    modules: dict[str, Any] = field(default_factory=dict)
    """The module graph: module name -> its section (``family`` picks the network and its role:
    one LLM, any number of encoders and generators). Filled from the three-module form when absent."""
    gen_loss_weight: float = 1.0
    """Weight of the diffusion loss added to the LM loss."""


@dataclass
class ModuleParallel:
    """Parallel degrees of one module (its own engine in the disaggregated layout)."""

    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline stages; must not exceed the module's layer count."""
    partition: str = "uniform"
    """How DeepSpeed splits layers over stages: uniform | parameters."""
    ds_config: str = ""
    """DeepSpeed JSON for this module's engine; empty uses the recipe's ``deepspeed_config``."""


@dataclass
class ParallelConfig:
    """Per-module degrees. The monolithic layout takes the LLM's DP/TP for all modules."""

    encoder: ModuleParallel | None = field(default_factory=ModuleParallel)
    """Encoder degrees."""
    llm: ModuleParallel | None = field(default_factory=lambda: ModuleParallel(pp=2))
    """LLM backbone degrees."""
    generator: ModuleParallel | None = field(default_factory=ModuleParallel)
    """Generator degrees."""
    modules: dict[str, ModuleParallel] = field(default_factory=dict)
    """With ``model.modules``: degrees per module name (a module not listed gets the defaults).
    Filled from the three-module form when absent."""
    comm_timeout_s: float = 300.0
    """Seconds a rank waits on the inter-engine communicator before failing with a clear error."""
    heartbeat_timeout_s: float = 20.0
    """Seconds without a heartbeat after which a rank counts as dead or hung and every rank stops."""


@dataclass
class TrainConfig:
    """Optimisation loop."""

    steps: int = 20
    """Optimizer steps to run."""
    global_batch: int = 4
    """Packed sequences per optimizer step, over all DP replicas."""
    micro_batch: int = 1
    """Sequences per LLM microbatch per DP replica."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter/compute precision (fp16 is not supported on CPU)."""
    peak_tflops: float = 0.0
    """Accelerator peak for MFU; 0 looks the device up (A100 312, H100 989, ...) or, on CPU,
    measures a matmul estimate once."""
    device_memory_gib: float = 0.0
    """Memory of one rank's device in GiB (2^30 bytes) that ``--dry-run`` and the check before
    training hold each rank's estimated peak against; 0: this machine's GPU, or without one its
    RAM shared by the job's ranks on it."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in ``checkpoint.dir`` if there is one;
    none: start from scratch (refused if ``checkpoint.dir`` already holds checkpoints);
    or the path of one checkpoint step directory."""
    on_nonfinite: Literal["stop", "continue"] = "stop"
    """stop: a NaN or infinite loss ends the job with one line naming the step, on every rank, before
    that step is checkpointed; continue: log it and train on. There is no ``skip``: each DeepSpeed
    engine applies its update inside its own schedule, before the step's loss is known everywhere."""


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule (one schedule; peak rates per module if given)."""

    name: Literal["adamw", "sgd"] = "adamw"
    """torch.optim.AdamW or torch.optim.SGD."""
    lr: float = 1e-3
    """Peak learning rate."""
    module_lr: dict[str, float] = field(default_factory=dict)
    """Peak learning rate per module name (e.g. ``{encoder: 1e-4}``) or per projector
    (``<module>/projector``; default: its module's rate); modules not listed use ``lr``."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to ``lr``."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate decay after warm-up."""
    grad_clip: float = 0.0
    """Gradient-norm clipping per module; 0 disables it."""


@dataclass
class CheckpointConfig:
    """Periodic checkpoints of every module engine, the data order and RNG states."""

    dir: str = ""
    """Directory of step directories (``step_00000100/``); empty means checkpoints/<recipe name>.
    Must be on a filesystem every node sees."""
    every: int = 0
    """Save after every N optimizer steps (and after the last step); 0 disables checkpoints."""
    keep: int = 3
    """Complete checkpoints kept (oldest removed first); 0 keeps all."""
    sigterm_grace_s: float = 120.0
    """After SIGTERM every rank saves a checkpoint at the next step boundary and exits 143; if no
    boundary is reached within this many seconds the rank exits 143 without saving. 0: no limit."""


@dataclass
class EmulateConfig:
    """Emulated compute: every forward/backward waits the time the cost model gives its samples.

    Processes, rank groups, the communicator, the schedule, reordering and data producers stay
    real; the (tiny) layers still run so real tensors flow, and each op then waits until its
    emulated duration has passed (``disttrain_ds/runtime/emulate.py``, ``docs/benchmarks.md``).
    """

    enabled: bool = False
    """Replace each module's forward/backward time by its emulated cost."""
    profile: str = ""
    """Planner profile JSON whose ``cost_ms`` give each module's mean fwd+bwd ms per sample;
    empty: the recipe's cost model (FLOPs) at ``tflops``."""
    time_scale: float = 1.0
    """Factor on every emulated time (e.g. 0.05 runs a profile's seconds as tens of ms)."""
    tflops: float = 0.0
    """Without ``profile``: sustained TFLOP/s that turn the cost model's FLOPs into time."""
    calibration_batches: int = 4
    """With ``profile``: global batches of the recipe's data (from step 0) over which a module's
    mean per-sample cost equals its profiled ``cost_ms``."""


@dataclass
class LoggingConfig:
    """Where results go."""

    dir: str = ""
    """Run directory; empty means runs/<recipe name>. An existing non-empty one is never reused."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline works with no network or account."""
    project: str = "disttrain-ds"
    """wandb project."""
    every: int = 1
    """Print a progress line every N steps."""


@dataclass
class Recipe:
    """A whole training job."""

    name: str = "run"
    """Run name (default run directory and wandb run name)."""
    layout: Literal["reference", "monolithic", "disaggregated"] = "reference"
    """reference: one process; monolithic: one pipeline sharing the LLM's DP; disaggregated: one engine per module."""
    seed: int = 1234
    """Seed for weights, data and diffusion noise; equal seeds give equal runs in every layout."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Module sizes."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data source and packing."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Per-module parallel degrees."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop settings."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer settings."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and what resuming reads."""
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    """Emulated compute for benchmarks of the runtime on machines without the real accelerators."""
    deepspeed_config: str = "ds_configs/cpu_fp32.json"
    """DeepSpeed JSON used by every module engine unless the module names its own. A relative path
    is looked up beside the recipe, in the working directory, then among the shipped ``ds_configs/``."""
    source_file: str = ""
    """Set by the loader: the recipe file this came from (for error messages)."""


def _apply_presets(data: dict, src: str) -> dict:
    """Expand ``model.<module>.preset`` (a preset of the module's family) into its field values;
    explicit fields win."""
    model = data.get("model")
    if not isinstance(model, dict):
        return data
    for module, default in DEFAULT_FAMILY.items():
        section = model.get(module)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{src}: 'model.{module}' must be a mapping")
        fam = get_family(section.get("family", default), module, src, f"model.{module}.family")
        if fam.config_type is not get_family(default, module).config_type:
            raise ConfigError(f"{src}: 'model.{module}.family' {fam.name} has its own settings: write the model "
                              f"as model.modules (e.g. model.modules.{module}: {{family: {fam.name}}})")
        presets = fam.presets
        name = section.get("preset", "tiny")
        if not isinstance(name, str) or name not in presets:
            raise ConfigError(f"{src}: 'model.{module}.preset' must be one of {' | '.join(presets)}, got {name!r}")
        model[module] = {**presets[name], **section, "preset": name}
    return data


def shipped_recipes() -> list[str]:
    """Names of the recipes shipped with the package."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def find_recipe(recipe: str | Path) -> Path:
    """The recipe file ``recipe`` names: a path as given, or for a bare name (no ``/``, no
    ``.yaml``) that is not a file here, the shipped recipe of that name."""
    text = str(recipe)
    if "/" in text or os.sep in text or text.endswith((".yaml", ".yml")) or Path(text).is_file():
        return Path(recipe)
    path = RECIPES_DIR / f"{text}.yaml"
    if text and path.is_file():
        return path
    raise ConfigError(f"recipe {text!r}: no shipped recipe of that name (shipped: "
                      f"{', '.join(shipped_recipes()) or 'none'}); give a YAML path for any other recipe")


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Parse and validate a recipe (a YAML path or a shipped recipe's name) with ``a.b=c`` overrides."""
    path = find_recipe(path)
    src = str(path)
    data = apply_overrides(load_yaml(path), overrides or [])
    data = _apply_presets(expand_graph_sections(data, src), src)
    recipe = from_dict(Recipe, data, src=src)
    recipe.source_file = src
    link_sections(recipe)
    _anchor_paths(recipe)
    validate(recipe)
    return recipe


def _input_paths(r: Recipe) -> list[tuple[object, str]]:
    """(section, attribute) of each file a recipe reads through ``resolve_path``."""
    modules = r.parallel.modules.values()
    return [(r, "deepspeed_config"), *((m, "ds_config") for m in modules), (r.emulate, "profile")]


def _anchor_paths(r: Recipe) -> None:
    """Replace each relative input path that resolves by its absolute path, so every process
    (whatever its working directory) reads the file validation read. Unresolved paths are left
    for ``validate`` to report."""
    for section, attr in _input_paths(r):
        value = getattr(section, attr)
        if value and not Path(value).is_absolute():
            found = next((c for c in path_candidates(value, r.source_file) if c.is_file()), None)
            if found is not None:
                setattr(section, attr, str(found))


RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
"""A run name: letters, digits and ``._-``, not starting with ``.``, 1 to 100 characters."""


def _check(cond: bool, src: str, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{src}: '{key}' {msg}")


def layer_counts(recipe: Recipe) -> dict[str, int]:
    """Pipeline layers per module (what PP may split): the family's, plus the projector of an
    encoder or generator."""
    out = {}
    for name in graph_of(recipe).names:
        fam = module_family(recipe, name)
        out[name] = fam.layer_count(module_config(recipe, name)) + (fam.role != "llm")
    return out


def tp_shape_problem(recipe, module: str, tp: int) -> tuple[str, str] | None:
    """(recipe key, why) of the first size that ``tp`` does not divide in ``module``, or None."""
    fam, cfg, prefix = module_family(recipe, module), module_config(recipe, module), module_key(recipe, module)
    llm = graph_of(recipe).llm
    llm_hidden = module_config(recipe, llm).hidden_size
    checks = fam.tp_sizes(cfg, prefix, llm_hidden)
    if fam.role == "encoder":  # the input projector's hidden width is the LLM's
        checks.append((f"{module_key(recipe, llm)}.hidden_size", llm_hidden))
    elif fam.role == "generator":  # the output projector's hidden width is the conditioning width
        checks.insert(0, (f"{prefix}.{fam.width_key}", fam.width(cfg)))
    for key, value in checks:
        if value % tp:
            return key, f"{value} does not split over the {module}'s tensor-parallel degree {tp}"
    return None


def validate(r: Recipe) -> None:
    """Cross-field checks that need no processes."""
    src = r.source_file or "<recipe>"
    graph = graph_of(r)
    for name in graph.names:
        fam = module_family(r, name)  # also catches a family override that skipped the preset expansion
        _check(not fam.not_trainable, src, f"{module_key(r, name)}.family",
               f"{fam.name} cannot be trained yet: {fam.not_trainable}")
    t, p = r.train, r.parallel
    _check(RUN_NAME.fullmatch(r.name) is not None, src, "name", f"must be a plain name (letters, digits, '._-', "
           f"not starting with '.', 1 to 100 characters): it names the run directory, got {r.name!r}")
    _check(0 <= r.seed < 2**63, src, "seed", f"must be in [0, 2**63), got {r.seed}")
    # Model sizes first: the layer counts and patch size below depend on them.
    m = r.model
    for name in graph.names:
        cfg, key = module_config(r, name), module_key(r, name)
        for f, v in vars(cfg).items():
            if isinstance(v, int) and not isinstance(v, bool) and f != "vocab_size":
                _check(v >= 1, src, f"{key}.{f}", f"must be >= 1, got {v}")
        for bad_key, msg in module_family(r, name).problems(cfg, key):
            raise ConfigError(f"{src}: '{bad_key}' {msg}")
    llm_parallel = module_parallel(r, graph.llm)
    _check(m.gen_loss_weight >= 0, src, "model.gen_loss_weight", f"must be >= 0, got {m.gen_loss_weight}")
    _check(t.steps >= 1, src, "train.steps", f"must be >= 1, got {t.steps}")
    _check(t.global_batch >= 1, src, "train.global_batch", f"must be >= 1, got {t.global_batch}")
    _check(t.micro_batch >= 1, src, "train.micro_batch", f"must be >= 1, got {t.micro_batch}")
    _check(t.peak_tflops >= 0, src, "train.peak_tflops", f"must be >= 0 (0: look the device up), got {t.peak_tflops}")
    _check(t.device_memory_gib >= 0, src, "train.device_memory_gib", f"must be >= 0 (0: this machine's), got {t.device_memory_gib}")
    llm_dp_key = f"{parallel_key(r, graph.llm)}.dp"
    _check(llm_parallel.dp >= 1, src, llm_dp_key, f"must be >= 1, got {llm_parallel.dp}")
    slot = llm_parallel.dp * t.micro_batch
    _check(
        t.global_batch % slot == 0,
        src,
        "train.global_batch",
        f"{t.global_batch} must be divisible by {llm_dp_key} * train.micro_batch = {slot}",
    )
    counts = layer_counts(r)
    for name in graph.names:
        mp: ModuleParallel = module_parallel(r, name)
        pkey = parallel_key(r, name)
        for axis in ("dp", "tp", "pp"):
            v = getattr(mp, axis)
            _check(v >= 1, src, f"{pkey}.{axis}", f"must be >= 1, got {v}")
        _check(mp.tp in (1, 2, 4, 8), src, f"{pkey}.tp", f"must be 1, 2, 4 or 8, got {mp.tp}")
        _check(mp.pp <= counts[name], src, f"{pkey}.pp", f"{mp.pp} exceeds the module's {counts[name]} pipeline layers")
        _check(mp.partition in ("uniform", "parameters"), src, f"{pkey}.partition", "must be uniform | parameters")
        if name != graph.llm and r.layout == "disaggregated":
            _check(slot % mp.dp == 0, src, f"{pkey}.dp", f"{mp.dp} must divide {llm_dp_key} * train.micro_batch = {slot}")
    if r.layout != "reference":
        # Monolithic: encoder and generator stages share the LLM's TP degree.
        for name in graph.names:
            tp = llm_parallel.tp if r.layout == "monolithic" else module_parallel(r, name).tp
            bad = tp_shape_problem(r, name, tp) if tp > 1 else None
            if bad:
                raise ConfigError(f"{src}: '{bad[0]}' {bad[1]}")
    _check(r.optim.lr > 0, src, "optim.lr", f"must be > 0, got {r.optim.lr}")
    for key, lr in r.optim.module_lr.items():
        module, _, part = key.partition("/")
        known = module in graph.names and part in ("", "projector") and not (part and module == graph.llm)
        _check(known, src, f"optim.module_lr.{key}", f"names no module or projector (modules: {', '.join(graph.names)}; "
               "projectors: <encoder or generator>/projector)")
        _check(lr > 0, src, f"optim.module_lr.{key}", f"must be > 0, got {lr}")
    o = r.optim
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), src, "optim.betas",
           f"must be two numbers in [0, 1), got {o.betas}")
    _check(o.eps > 0, src, "optim.eps", f"must be > 0, got {o.eps}")
    _check(o.weight_decay >= 0, src, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _check(o.warmup_steps >= 0, src, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(o.grad_clip >= 0, src, "optim.grad_clip", f"must be >= 0 (0: no clipping), got {o.grad_clip}")
    _check(r.parallel.comm_timeout_s > 0, src, "parallel.comm_timeout_s", "must be > 0")
    _check(r.parallel.heartbeat_timeout_s > 0, src, "parallel.heartbeat_timeout_s", "must be > 0")
    _check(r.logging.every >= 1, src, "logging.every", "must be >= 1")
    c = r.checkpoint
    _check(c.every >= 0, src, "checkpoint.every", f"must be >= 0, got {c.every}")
    _check(c.keep >= 0, src, "checkpoint.keep", f"must be >= 0, got {c.keep}")
    _check(c.sigterm_grace_s >= 0, src, "checkpoint.sigterm_grace_s", f"must be >= 0, got {c.sigterm_grace_s:g}")
    e = r.emulate
    _check(e.time_scale >= 0, src, "emulate.time_scale", f"must be >= 0, got {e.time_scale}")
    _check(e.calibration_batches >= 1, src, "emulate.calibration_batches", f"must be >= 1, got {e.calibration_batches}")
    if e.enabled:
        from .runtime.emulate import check_emulate  # local import: keeps config parsing light

        check_emulate(r, src)
    _check(bool(t.resume), src, "train.resume", "must be auto, none or a checkpoint path")
    if r.layout == "reference":
        _check(c.every == 0, src, "checkpoint.every", "checkpoints are written by the monolithic and disaggregated layouts; "
               "the reference layout is for comparisons (set checkpoint.every=0)")
    elif t.resume not in ("auto", "none"):
        _check(Path(t.resume).is_dir(), src, "train.resume", f"{t.resume} is not a directory (expected auto, none or a checkpoint step directory)")
    d = r.data
    _check(d.seq_len >= 16, src, "data.seq_len", f"must be >= 16, got {d.seq_len}")
    images = [n for n in graph.encoders if module_family(r, n).name == "vit"]
    for name in images:
        patch = module_config(r, name).patch_size
        for s in d.image_sizes:
            _check(s > 0 and s % patch == 0, src, "data.image_sizes",
                   f"{s} is not a positive multiple of the patch size {patch} ({module_key(r, name)}.patch_size)")
    _check(bool(images) or d.max_images == 0, src, "data.max_images",
           f"must be 0: the model has no image encoder, got {d.max_images}")
    _check(not images or d.max_images >= 1 or d.source != "synthetic", src, "data.max_images",
           "must be >= 1: the synthetic source draws 1..max_images images for the image encoder")
    _check(len(graph.encoders) <= 1 and len(graph.generators) <= 1, src, "model.modules",
           "the runtime trains at most one encoder and one generator so far; "
           f"got encoders {list(graph.encoders)} and generators {list(graph.generators)}")
    gen = module_config(r, graph.generators[0]) if graph.generators else None
    _check(gen is not None or d.gen_prob == 0, src, "data.gen_prob",
           f"must be 0: the model has no generator, got {d.gen_prob}")
    from .data.config import data_problem

    bad = data_problem(d, gen.query_tokens if gen is not None else 1)
    if bad:
        raise ConfigError(f"{src}: 'data.{bad[0]}' {bad[1]}")
    # Real images give RGB generation targets; a latent-space generator (e.g. the sd21 preset's 4
    # channels) would need a VAE in the data pipeline, which there is not.
    if gen is not None:
        _check(d.source not in ("mmc4", "laion", "local") or gen.in_channels == 3, src,
               f"{module_key(r, graph.generators[0])}.in_channels",
               f"data.source {d.source} produces RGB generation targets (3 channels), got {gen.in_channels}; "
               "use data.source=paper_stats or synthetic for a latent-space generator")
    for name in graph.names:
        ckpt = module_config(r, name).checkpoint
        _check(not ckpt or Path(ckpt).exists(), src, f"{module_key(r, name)}.checkpoint", f"{ckpt} does not exist")
    if not any(trains(module_config(r, n)) for n in graph.names):
        raise ConfigError(f"{src}: 'model': every module is frozen; nothing would train")
    for name in (*graph.encoders, *graph.generators):
        cfg, pp = module_config(r, name), module_parallel(r, name).pp
        # Stages without trainable weights skip DeepSpeed's optimizer collectives (gradient norm,
        # overflow checks) that the projector's stage would wait for.
        _check(not (cfg.frozen and trains(cfg)) or r.layout != "disaggregated" or pp == 1, src,
               f"{parallel_key(r, name)}.pp",
               f"must be 1 when {module_key(r, name)}.frozen is set and its projector trains (got {pp})")
    from .dsconfig import load_ds_config  # local import: keeps config parsing free of DeepSpeed

    for name in graph.names:
        mp = module_parallel(r, name)
        path = mp.ds_config or r.deepspeed_config
        key = f"{parallel_key(r, name)}.ds_config" if mp.ds_config else "deepspeed_config"
        load_ds_config(require_file(path, key, src, r.source_file), key=key, recipe_src=src)


def path_candidates(path: str | Path, recipe_file: str | Path = "") -> list[Path]:
    """Where a relative path in a recipe may be, in order: beside the recipe file, in the working
    directory, in the package's shipped data (``ds_configs/zero1.json``). An absolute path is itself."""
    p = Path(path)
    if p.is_absolute():
        return [p]
    bases = [Path(recipe_file).absolute().parent] if recipe_file else []
    return list(dict.fromkeys(base / p for base in (*bases, Path.cwd(), PACKAGE_DIR)))


def resolve_path(path: str | Path, recipe_file: str | Path = "") -> Path:
    """The first of ``path_candidates`` that exists, else ``path`` unchanged."""
    return next((c for c in path_candidates(path, recipe_file) if c.exists()), Path(path))


def require_file(path: str | Path, key: str, recipe_src: str, recipe_file: str | Path = "") -> Path:
    """The file a recipe's ``key`` names; a one-line ``ConfigError`` naming the key and the
    places tried when there is none."""
    candidates = path_candidates(path, recipe_file)
    found = next((c for c in candidates if c.is_file()), None)
    if found is not None:
        return found
    if len(candidates) == 1:
        what = " (a directory)" if candidates[0].is_dir() else ""
        raise ConfigError(f"{recipe_src}: '{key}' file not found: {path}{what}")
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"{recipe_src}: '{key}' file not found: {path} (tried {tried})")
