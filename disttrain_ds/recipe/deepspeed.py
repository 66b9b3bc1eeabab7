"""DeepSpeed JSON configs: strict validation and completion from the recipe.

DeepSpeed silently ignores unknown top-level keys, so a typo like ``"zero_optimisation"`` trains
without ZeRO. Here unknown keys are errors. Batch sizes and the optimizer belong to the recipe
(``train.*``, ``optim.*``) and are filled in per engine, so they may not appear in the file.
``zero_optimization.overlap_comm: true`` is refused: its device-wide synchronisations can hang
under the boundary receives the runtime posts ahead of need (``_overlap_comm_problem``). Recipe
loading (``recipe/checks.py``) reads every module's file, so ``--dry-run`` and ``disttrain-launch``
report these before anything starts.
"""

from __future__ import annotations

import copy
from pathlib import Path

from disttrain_ds.configtools import load_json
from disttrain_ds.errors import ConfigError

KNOWN_KEYS = frozenset(
    """
    fp16 bf16 amp zero_optimization gradient_clipping steps_per_print wall_clock_breakdown
    prescale_gradients gradient_predivide_factor communication_data_type pipeline activation_checkpointing
    tensorboard wandb csv_monitor comet flops_profiler zero_allow_untested_optimizer
    zero_force_ds_cpu_optimizer checkpoint data_types dump_state memory_breakdown sparse_gradients aio
    comms_logger compile timers torch_autocast data_efficiency curriculum_learning
    load_universal_checkpoint use_node_local_storage dataloader_drop_last disable_allgather
    seq_parallel_communication_data_type graph_harvesting gradient_accumulation_dtype
    """.split()
)
SECTIONS = frozenset(
    """
    fp16 bf16 amp zero_optimization pipeline activation_checkpointing tensorboard wandb csv_monitor comet
    flops_profiler checkpoint data_types aio comms_logger compile timers torch_autocast data_efficiency
    curriculum_learning
    """.split()
)
"""Known keys whose value is a JSON object."""
FLAGS = frozenset(
    """
    wall_clock_breakdown prescale_gradients zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    dump_state memory_breakdown sparse_gradients load_universal_checkpoint use_node_local_storage
    dataloader_drop_last disable_allgather graph_harvesting
    """.split()
)
"""Known keys whose value is true or false."""
NUMBERS = {"steps_per_print": int, "gradient_clipping": float, "gradient_predivide_factor": float}
"""Known keys whose value is a number (int: a whole one)."""
RECIPE_OWNED = {
    "train_batch_size": "train.global_batch",
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.global_batch / (parallel.llm.dp * train.micro_batch)",
    "optimizer": "optim.*",
    "scheduler": "optim.warmup_steps / optim.schedule",
}


def _overlap_comm_problem(value: object) -> str | None:
    """Why ``zero_optimization.overlap_comm`` may not be ``value``, or None.

    With it on, DeepSpeed's ZeRO-1/2 optimizer calls ``get_accelerator().synchronize()`` (the whole
    device) before each gradient reduction (``runtime/zero/stage_1_and_2.py``). The boundary
    receives posted ahead of need (``comm/boundary.py`` ``prefetch_*``) sit on the communicator's
    side stream until their peer sends, and that peer may itself be waiting on this rank, so the
    device-wide wait can hang the job. Its default is off below ZeRO-3, the only stages allowed here.
    """
    if not isinstance(value, bool):
        return f"'zero_optimization.overlap_comm' must be true or false, got {value!r}"
    if value:
        return ("zero_optimization.overlap_comm true synchronises the GPU under parked boundary receives "
                "and can hang; set it false")
    return None


def load_ds_config(path: Path, *, key: str = "deepspeed_config", recipe_src: str = "<recipe>") -> dict:
    """Read and validate a DeepSpeed JSON; errors name the file and the offending key."""
    if not path.is_file():
        raise ConfigError(f"{recipe_src}: '{key}' file not found: {path}")
    cfg = load_json(path)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    for k, v in cfg.items():
        if k in RECIPE_OWNED:
            raise ConfigError(f"{path}: '{k}' is set by the recipe ({RECIPE_OWNED[k]}); remove it from the JSON")
        if k not in KNOWN_KEYS:
            raise ConfigError(f"{path}: unknown DeepSpeed key '{k}'")
        # DeepSpeed reads these without type checks and fails (or misbehaves) mid-run.
        if k in SECTIONS and not isinstance(v, dict):
            raise ConfigError(f"{path}: '{k}' must be an object, got {v!r}")
        if k in FLAGS and not isinstance(v, bool):
            raise ConfigError(f"{path}: '{k}' must be true or false, got {v!r}")
        if k in NUMBERS and (isinstance(v, bool) or not isinstance(v, int if NUMBERS[k] is int else (int, float))):
            raise ConfigError(f"{path}: '{k}' must be {'an integer' if NUMBERS[k] is int else 'a number'}, got {v!r}")
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{path}: 'zero_optimization' must be an object")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1):
        raise ConfigError(f"{path}: 'zero_optimization.stage' {stage!r} is incompatible with pipeline parallelism (use 0 or 1)")
    overlap_problem = _overlap_comm_problem(zero.get("overlap_comm", False))
    if overlap_problem:
        raise ConfigError(f"{path}: {overlap_problem}")
    for prec in ("fp16", "bf16"):
        sec = cfg.get(prec, {})
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: '{prec}' must be an object")
    if cfg.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{path}: 'fp16' is not supported; use bf16 (train.dtype=bf16)")
    if "enabled" in cfg.get("bf16", {}):
        raise ConfigError(f"{path}: 'bf16.enabled' is set by the recipe (train.dtype); remove it from the JSON")
    return cfg


def engine_config(
    base: dict, *, micro_batch: int, grad_accum: int, dp: int, dtype: str, grad_clip: float, frozen: bool = False
) -> dict:
    """The complete DeepSpeed config of one module engine."""
    cfg = copy.deepcopy(base)
    if frozen:  # no optimizer, so no optimizer state for ZeRO to shard
        cfg.pop("zero_optimization", None)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["train_batch_size"] = micro_batch * grad_accum * dp
    # DeepSpeed clips at 1.0 unless told otherwise; the recipe decides.
    cfg["gradient_clipping"] = grad_clip
    cfg.setdefault("steps_per_print", 10**9)
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": dtype == "bf16"}
    # Engines save under different tags (their module names) into one step directory.
    cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "tag_validation": "Ignore"}
    # DeepSpeed's partitioned stage-to-stage activations cache one shape; ours vary per microbatch.
    cfg["pipeline"] = {**cfg.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    return cfg
