"""Recipe schema: one YAML file (plus ``a.b=c`` overrides) describes a whole training job.

``load_recipe`` validates everything that can be checked before any process group starts and
raises ``ConfigError`` with one line naming the key and the file. A recipe is a YAML path or the
name of one shipped with the package (``tiny_cpu`` is ``disttrain_ds/recipes/tiny_cpu.yaml``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from disttrain_ds.configtools import apply_overrides, from_dict, load_yaml
from disttrain_ds.data.config import DataConfig
from disttrain_ds.errors import ConfigError
from disttrain_ds.families import DEFAULT_FAMILY, default_config, get_family
from disttrain_ds.paths import PACKAGE_DIR, path_candidates, require_file, resolve_path
from disttrain_ds.recipe.checkpoint_settings import checkpoint_fields
from disttrain_ds.recipe.checks import RUN_NAME, layer_counts, tp_shape_problem, validate
from disttrain_ds.recipe.graph import expand_graph_sections, link_sections

__all__ = ["RUN_NAME", "PACKAGE_DIR", "layer_counts", "load_recipe", "path_candidates", "require_file",
           "resolve_path", "tp_shape_problem", "validate"]

RECIPES_DIR = PACKAGE_DIR / "recipes"
"""Shipped recipes, found by name (``--recipe tiny_cpu``)."""


@dataclass
class ModelConfig:
    """The modules and how their losses combine: the three-module form (``encoder``, ``llm``,
    ``generator``) or a module graph (``modules``); see ``recipe/graph.py``."""

    encoder: Any = field(default_factory=lambda: default_config("encoder"))
    """Three-module form: the image encoder (ViT + input projector). With ``modules``: the only
    encoder, if there is exactly one (else None)."""
    llm: Any = field(default_factory=lambda: default_config("llm"))
    """Three-module form: the LLM backbone. With ``modules``: the LLM."""
    generator: Any = field(default_factory=lambda: default_config("generator"))
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
    sp: int | Literal["auto"] = 1
    """Sequence-parallel degree (Ulysses, the LLM only): ranks per replica that each hold a slice
    of every sequence and exchange heads for sequence around attention. The module then runs on
    dp x sp x tp x pp ranks; heads (and KV heads, or SP by them) and data.seq_len split by it.
    ``auto`` (FlexSP): the module's ``dp`` ranks (a power of two) form, per microbatch, SP groups
    of different power-of-two sizes, each running some of the microbatch's sequences
    (``reorder/sp_groups.py``); the module runs on dp x tp x pp ranks."""
    tp_overlap: bool | Literal["auto"] = "auto"
    """With tp > 1: between transformer blocks each TP rank keeps a 1/tp slice of every sequence, of an
    encoder's packed image or clip rows, or of a generator's tokens of every image (Megatron's
    sequence parallelism: norms and residuals on 1/tp of the tokens), and every all-gather + GEMM
    and GEMM + reduce-scatter runs in ``tp_overlap_chunks`` pieces so the collective of one
    overlaps the GEMM of another (``parallel/tp_sequence.py``). Same math as without. auto: on
    CUDA where it applies (a family with a path on slices, tp > 1, no sp, for the LLM data.seq_len
    split by tp, for a generator its tokens per image); true: also on CPU, refused where it cannot
    apply; false: activations replicated over TP."""
    tp_overlap_chunks: int = 4
    """With ``tp_overlap``: pieces each collective + GEMM is cut into (1: sharded, not overlapped);
    for the LLM at most data.seq_len / tp; an encoder's microbatch with fewer rows per slice runs
    in fewer."""
    pp: int = 1
    """Pipeline stages; must not exceed the module's layer count."""
    partition: str = "uniform"
    """How DeepSpeed splits layers over stages: uniform | parameters."""
    ds_config: str = ""
    """DeepSpeed JSON for this module's engine; empty uses the recipe's ``deepspeed_config``."""
    activation_checkpointing: int = 0
    """Recompute activations in backward instead of keeping them: each stage's layers are run in
    checkpointed blocks of this many pipeline layers (DeepSpeed's ``activation_checkpoint_interval``);
    only a block's input is kept per microbatch. 0 keeps every activation."""


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
    startup_timeout_s: float = 600.0
    """Seconds ranks wait for one another at start: for every rank to reach the job's store, and for
    a watched rank's first heartbeat, counted from when its watchers start (the heartbeat judges a
    rank not yet seen by this, not by ``heartbeat_timeout_s``, below which it never falls); a rank
    not there by then stops the job, named."""
    post_balance: bool = False
    """Disaggregated layout (the reference runs the same math; monolithic refuses it): every encoder
    and generator assigns each microbatch's units of work (an encoder's images or audio clips, a
    generator's target images) to its own DP replicas by its own per-unit costs (unequal counts
    allowed; ``reorder/post_balance.py``), and the boundaries route each unit between the replicas
    that hold it; the LLM keeps its contiguous blocks. Off: every module takes contiguous, equal
    blocks of samples of one order."""
    post_balance_share: float = 2.0
    """With ``post_balance``: the most units one replica takes from a microbatch, as a multiple of
    its even share (>= 1; the memory estimate counts that many per replica)."""
    sp_bandwidth_gbs: list[float] = field(default_factory=lambda: [100.0, 10.0])
    """With ``sp: auto``: the all-to-all bandwidth per GPU (GB/s) of an SP group inside one node and
    of one across nodes, which the groups are priced by (measure yours, e.g. nccl-tests' alltoall_perf)."""


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

    compile: bool | Literal["auto"] = "auto"
    """Compile each pipeline layer in place with ``torch.compile`` (``models/compiled.py``: the same
    parameter names, checkpoints and export; shapes that vary become dynamic after one recompile;
    ``compile/graphs`` in the metrics counts the graphs made). auto: on CUDA only; true: on CPU too
    (inductor, needs a C++ compiler; the first step takes minutes); false: eager."""

    peak_tflops: float = 0.0
    """Accelerator peak for MFU; 0 looks the device up (A100 312, H100 989, ...) or, on CPU,
    measures a matmul estimate once."""
    device_memory_gib: float = 0.0
    """Memory of one rank's device in GiB (2^30 bytes) that ``--dry-run`` and the check before
    training hold each rank's estimated peak against; 0: this machine's GPU, or without one its
    RAM shared by the job's ranks on it."""
    gpu_allowance: bool = True
    """Against a GPU's memory (``device_memory_gib``, this machine's GPU, a plan's ``gpu_memory_gb``)
    also count what a rank holds beside its tensors: CUDA context and GEMM workspaces, NCCL buffers,
    allocator fragmentation (``estimate/gpu_allowance.py``). false: the estimate alone, for CPU
    recipes whose ``device_memory_gib`` stands for a small device."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in ``checkpoint.dir`` if there is one;
    none: start from scratch (refused if ``checkpoint.dir`` already holds checkpoints);
    or the path of one checkpoint step directory."""
    init_from: str = ""
    """A training checkpoint step directory whose weights every module starts from (those without a
    ``model.<module>.checkpoint`` of their own): weights only, a new optimizer, step 0 (fine-tuning
    stages). Independent of ``resume``, which continues a run of this very recipe."""
    on_nonfinite: Literal["stop", "continue"] = "stop"
    """stop: a NaN or infinite loss ends the job with one line naming the step, on every rank, before
    that step is checkpointed; continue: log it and train on. There is no ``skip``: each DeepSpeed
    engine applies its update inside its own schedule, before the step's loss is known everywhere."""

    @property
    def value_bytes(self) -> int:
        """Bytes of one value in ``dtype`` (activations, all-to-alls)."""
        return 2 if self.dtype == "bf16" else 4


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
    lock_timeout_s: float = 120.0
    """A job holds ``dir`` (and its run directory) with a lock file it renews every quarter of this;
    another job is refused while the lock is fresher than this (``checkpoint/lock.py``). Hosts'
    clocks must agree within it."""


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
    """Planner profile JSON whose ``cost_ms`` give each module's mean fwd+bwd ms per sample (it
    must name the recipe's modules, e.g. one the profiler wrote for this recipe); empty: the
    recipe's cost model (FLOPs) at ``tflops``."""
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
class EvalConfig:
    """Validation loss on a held-out split of the data (``data/split.py``): forward passes only,
    no optimizer step, no change to the training data order or RNG."""

    every: int = 0
    """Evaluate after every N optimizer steps (and after the last step); 0 turns evaluation off."""
    batches: int = 2
    """Held-out global batches (``train.global_batch`` samples each) per evaluation; the same
    batches every time, so the figures are comparable across steps."""
    holdout_fraction: float = 0.0
    """Record and shard sources (mmc4, laion, local, webdataset, parquet, folder, hf): the share of records held out of training for
    evaluation, a fixed choice that depends only on the record count. Above 0 it takes those
    records out of training whether or not ``every`` is set. Synthetic sources hold out a separate
    seed space instead and need no fraction (it must stay 0)."""


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation loss on held-out data."""
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    """Emulated compute for benchmarks of the runtime on machines without the real accelerators."""
    deepspeed_config: str = "ds_configs/cpu_fp32.json"
    """DeepSpeed JSON used by every module engine unless the module names its own. A relative path
    is looked up beside the recipe, in the working directory, then among the shipped ``ds_configs/``."""
    source_file: str = ""
    """Set by the loader: the recipe file this came from (for error messages)."""


def _apply_presets(data: dict, src: str) -> dict:
    """Expand ``model.<module>.preset`` (a preset of the module's family) into its field values,
    then the checkpoint's ``config.json`` over them (``recipe/checkpoint_settings.py``); explicit
    fields win where they agree with the checkpoint."""
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
        fixed = checkpoint_fields(fam, section, f"model.{module}", src)  # its config.json, over the preset
        model[module] = from_dict(fam.config_type, {**presets[name], **fixed, **section, "preset": name}, src=src,
                                  prefix=f"model.{module}.")
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
    recipe = recipe_from_data(apply_overrides(load_yaml(path), overrides or []), src)
    _apply_init_from(recipe)
    _anchor_paths(recipe)
    validate(recipe)
    return recipe


def recipe_from_data(data: dict, src: str) -> Recipe:
    """A recipe from plain data (presets expanded, both module forms linked), not yet validated:
    also how a checkpoint's recorded model and layout become a recipe again."""
    data = _apply_presets(expand_graph_sections(data, src), src)
    recipe = from_dict(Recipe, data, src=src)
    recipe.source_file = src
    link_sections(recipe, ModuleParallel)
    return recipe


def _apply_init_from(r: Recipe) -> None:
    """``train.init_from``: every module without its own ``checkpoint`` starts from the step directory's weights."""
    if r.train.init_from:
        for cfg in r.model.modules.values():
            cfg.checkpoint = cfg.checkpoint or r.train.init_from


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
