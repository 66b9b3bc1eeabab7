"""Cross-field checks of a loaded recipe: everything that can fail before any process starts.

Each check raises ``ConfigError`` with one line naming the key and the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from disttrain_ds.cost.profile import sp_head_problem
from disttrain_ds.cost.profile_file import load_profile
from disttrain_ds.data.config import RECORD_SOURCES, SHARD_PATHS, data_problem
from disttrain_ds.errors import ConfigError
from disttrain_ds.models.configs import trains
from disttrain_ds.models.vae_config import checkpoint_config, vae_problem
from disttrain_ds.paths import require_file
from disttrain_ds.recipe.deepspeed import load_ds_config
from disttrain_ds.recipe.graph import (
    graph_of,
    module_config,
    module_degrees,
    module_family,
    module_key,
    module_parallel,
    parallel_key,
    tp_overlap_blocked,
)

if TYPE_CHECKING:
    from disttrain_ds.graph import ModuleGraph
    from disttrain_ds.recipe.schema import ModuleParallel, Recipe

AUDIO_SOURCES = ("synthetic", "local", "webdataset", "parquet", "folder", "hf")
MULTI_GEN_SOURCES = ("synthetic", "local", "webdataset", "parquet", "folder", "hf")
"""Sources that give targets to several generators (records name a target's generator)."""
"""Values of ``data.source`` that produce audio clips."""
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


def graph_problem(graph: ModuleGraph, modality: Callable[[str], str] | None = None) -> str | None:
    """Why the runtime cannot train ``graph``, or None: the one rule recipe loading and the
    planner's ``--write-recipe`` share. ``modality``: encoder name -> what it reads (image |
    audio); without it (a profile knows roles only) the rule on modalities is left to the recipe."""
    # Any number of generators train: each has its own generation-query token and targets.
    if modality is not None:
        modalities = [modality(n) for n in graph.encoders]
        if len(set(modalities)) != len(modalities):
            return ("the runtime trains one encoder per modality so far (each fills its own placeholder token); "
                    f"got encoders {list(graph.encoders)} reading {modalities}")
    return None


def validate(r: Recipe) -> None:
    """Cross-field checks that need no processes, section by section (the first problem is
    raised as one line naming its key)."""
    src = r.source_file or "<recipe>"
    graph = graph_of(r)
    check_families(r, graph, src)
    check_run(r, graph, src)
    check_sizes(r, graph, src)
    check_train(r, graph, src)
    check_parallel(r, graph, src)
    check_optim(r, graph, src)
    check_runtime(r, graph, src)
    check_eval(r, src)
    check_emulation(r, graph, src)
    check_resume(r, graph, src)
    check_data(r, graph, src)
    check_weights(r, graph, src)
    check_deepspeed(r, graph, src)


def check_families(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """Every module's family can be trained."""
    for name in graph.names:
        fam = module_family(r, name)  # also catches a family override that skipped the preset expansion
        _check(not fam.not_trainable, src, f"{module_key(r, name)}.family",
               f"{fam.name} cannot be trained yet: {fam.not_trainable}")


def check_run(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``name`` and ``seed``."""
    _check(RUN_NAME.fullmatch(r.name) is not None, src, "name", f"must be a plain name (letters, digits, '._-', "
           f"not starting with '.', 1 to 100 characters): it names the run directory, got {r.name!r}")
    _check(0 <= r.seed < 2**63, src, "seed", f"must be in [0, 2**63), got {r.seed}")


def check_sizes(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """Every module's sizes: positive integers, and its family's own rules (checked first: layer
    counts and patch sizes depend on them)."""
    for name in graph.names:
        cfg, key, fam = module_config(r, name), module_key(r, name), module_family(r, name)
        for f, v in vars(cfg).items():
            if isinstance(v, int) and not isinstance(v, bool) and f not in fam.signed:
                _check(v >= 1, src, f"{key}.{f}", f"must be >= 1, got {v}")
        for bad_key, msg in fam.problems(cfg, key):
            raise ConfigError(f"{src}: '{bad_key}' {msg}")


def check_train(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``train`` and ``model.gen_loss_weight``: counts, and a global batch that fills whole microbatch
    slots of the LLM's DP."""
    t = r.train
    m = r.model
    llm_parallel = module_parallel(r, graph.llm)
    _check(m.gen_loss_weight >= 0, src, "model.gen_loss_weight", f"must be >= 0, got {m.gen_loss_weight}")
    _check(t.steps >= 1, src, "train.steps", f"must be >= 1, got {t.steps}")
    _check(t.global_batch >= 1, src, "train.global_batch", f"must be >= 1, got {t.global_batch}")
    _check(t.micro_batch >= 1, src, "train.micro_batch", f"must be >= 1, got {t.micro_batch}")
    _check(t.peak_tflops >= 0, src, "train.peak_tflops", f"must be >= 0 (0: look the device up), got {t.peak_tflops}")
    _check(t.device_memory_gib >= 0, src, "train.device_memory_gib", f"must be >= 0 (0: this machine's), got {t.device_memory_gib}")
    doc_attention = getattr(module_config(r, graph.llm), "doc_attention", "auto")
    _check(doc_attention != "varlen" or t.dtype == "bf16", src, f"{module_key(r, graph.llm)}.doc_attention",
           "varlen runs flash attention, which computes in bf16: set train.dtype=bf16, or doc_attention to "
           "auto, spans or flex")
    llm_dp_key = f"{parallel_key(r, graph.llm)}.dp"
    _check(llm_parallel.dp >= 1, src, llm_dp_key, f"must be >= 1, got {llm_parallel.dp}")
    slot = llm_parallel.dp * t.micro_batch
    _check(
        t.global_batch % slot == 0,
        src,
        "train.global_batch",
        f"{t.global_batch} must be divisible by {llm_dp_key} * train.micro_batch = {slot}",
    )


def check_parallel(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``parallel.<module>``: degrees, partitions, DP degrees that divide a slot, and TP degrees each
    module's shapes allow."""
    llm_parallel = module_parallel(r, graph.llm)
    slot = module_parallel(r, graph.llm).dp * r.train.micro_batch
    llm_dp_key = f"{parallel_key(r, graph.llm)}.dp"
    counts = layer_counts(r)
    for name in graph.names:
        mp: ModuleParallel = module_parallel(r, name)
        pkey = parallel_key(r, name)
        for axis in ("dp", "tp", "pp"):
            v = getattr(mp, axis)
            _check(v >= 1, src, f"{pkey}.{axis}", f"must be >= 1, got {v}")
        if mp.sp == "auto" or mp.sp > 1:
            check_sequence_parallel(r, graph, name, mp, src)
        else:
            _check(mp.sp >= 1, src, f"{pkey}.sp", f"must be >= 1 or auto, got {mp.sp}")
        _check(mp.tp in (1, 2, 4, 8), src, f"{pkey}.tp", f"must be 1, 2, 4 or 8, got {mp.tp}")
        _check(mp.tp_overlap_chunks >= 1, src, f"{pkey}.tp_overlap_chunks",
               f"must be an integer >= 1, got {mp.tp_overlap_chunks}")
        if mp.tp_overlap is True and mp.tp > 1 and r.layout != "reference":
            why = tp_overlap_blocked(r, name, mp.tp)
            _check(why is None, src, f"{pkey}.tp_overlap", why or "")
        _check(mp.pp <= counts[name], src, f"{pkey}.pp", f"{mp.pp} exceeds the module's {counts[name]} pipeline layers")
        _check(mp.partition in ("uniform", "parameters"), src, f"{pkey}.partition", "must be uniform | parameters")
        _check(mp.activation_checkpointing >= 0, src, f"{pkey}.activation_checkpointing",
               f"must be >= 0 (layers per checkpointed block; 0: off), got {mp.activation_checkpointing}")
        if name != graph.llm and r.layout == "disaggregated":
            _check(slot % mp.dp == 0, src, f"{pkey}.dp", f"{mp.dp} must divide {llm_dp_key} * train.micro_batch = {slot}")
    if r.parallel.post_balance:
        _check(r.layout != "monolithic", src, "parallel.post_balance",
               "needs modules on their own replicas (layout: disaggregated; the reference runs it as one process), "
               "got monolithic")
    bw = r.parallel.sp_bandwidth_gbs
    _check(len(bw) == 2 and all(b > 0 for b in bw), src, "parallel.sp_bandwidth_gbs",
           f"must be [inside a node, across nodes], both > 0 GB/s, got {bw}")
    _check(r.parallel.post_balance_share >= 1, src, "parallel.post_balance_share",
           f"must be >= 1 (a multiple of the even share), got {r.parallel.post_balance_share:g}")
    if r.layout != "reference":
        # Monolithic: encoder and generator stages share the LLM's TP degree.
        for name in graph.names:
            tp = llm_parallel.tp if r.layout == "monolithic" else module_parallel(r, name).tp
            bad = tp_shape_problem(r, name, tp) if tp > 1 else None
            if bad:
                raise ConfigError(f"{src}: '{bad[0]}' {bad[1]}")


def check_sequence_parallel(r: Recipe, graph: ModuleGraph, name: str, mp: ModuleParallel, src: str) -> None:
    """``parallel.<module>.sp`` > 1: where it runs, and the sizes it must split."""
    key = f"{parallel_key(r, name)}.sp"
    family = module_family(r, name)
    _check(family.sp_heads is not None, src, key,
           f"the {family.name} family has no sequence-parallel path (the LLM and the encoders have one), got sp={mp.sp}")
    _check(r.layout == "disaggregated", src, key,
           f"needs layout disaggregated (the module on its own ranks), got {r.layout}")
    sp = mp.sp
    if sp == "auto":  # every power of two up to dp may be a group's size
        _check(mp.dp & (mp.dp - 1) == 0, src, key, f"auto needs {parallel_key(r, name)}.dp a power of two "
               f"(groups are aligned powers of two), got {mp.dp}")
        sp = mp.dp
    heads, kv_heads = family.sp_heads(module_config(r, name))
    bad = sp_head_problem(heads, kv_heads, mp.tp, sp)
    _check(bad != "heads", src, key, f"heads per TP rank ({heads} / tp {mp.tp}) must be divisible by sp {sp}")
    _check(bad != "kv_heads", src, key,
           f"kv_heads per TP rank ({kv_heads} / tp {mp.tp}) must divide or be divisible by sp {sp}")
    if name == graph.llm:  # an encoder's packed rows are padded to a multiple of SP instead
        _check(r.data.seq_len % sp == 0, src, key, f"data.seq_len {r.data.seq_len} must be divisible by sp {sp}")


def check_optim(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``optim``: rates (per module and projector), betas, decay, warm-up, clipping."""
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


def check_runtime(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """Deadlines, logging and checkpoint cadence."""
    _check(r.parallel.comm_timeout_s > 0, src, "parallel.comm_timeout_s", "must be > 0")
    _check(r.parallel.heartbeat_timeout_s > 0, src, "parallel.heartbeat_timeout_s", "must be > 0")
    _check(r.parallel.startup_timeout_s > 0, src, "parallel.startup_timeout_s", "must be > 0")
    _check(r.logging.every >= 1, src, "logging.every", "must be >= 1")
    c = r.checkpoint
    _check(c.every >= 0, src, "checkpoint.every", f"must be >= 0, got {c.every}")
    _check(c.keep >= 0, src, "checkpoint.keep", f"must be >= 0, got {c.keep}")
    _check(c.sigterm_grace_s >= 0, src, "checkpoint.sigterm_grace_s", f"must be >= 0, got {c.sigterm_grace_s:g}")
    _check(c.lock_timeout_s > 0, src, "checkpoint.lock_timeout_s", f"must be > 0, got {c.lock_timeout_s:g}")


def check_emulation(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``emulate``: its scale and calibration, and its cross-section rules when on."""
    e = r.emulate
    _check(e.time_scale >= 0, src, "emulate.time_scale", f"must be >= 0, got {e.time_scale}")
    _check(e.calibration_batches >= 1, src, "emulate.calibration_batches", f"must be >= 1, got {e.calibration_batches}")
    if e.enabled:
        auto = [n for n in graph.names if module_parallel(r, n).sp == "auto"]
        _check(not auto, src, "emulate.enabled", f"emulated compute does not model adaptive SP groups yet "
               f"({', '.join(f'{n} sp=auto' for n in auto)}); run it for real or set a fixed sp")
        check_emulate(r, src)


def check_resume(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``train.resume`` and ``train.init_from`` name what exists; the reference layout writes no
    checkpoints."""
    t = r.train
    c = r.checkpoint
    _check(bool(t.resume), src, "train.resume", "must be auto, none or a checkpoint path")
    if r.layout == "reference":
        _check(c.every == 0, src, "checkpoint.every", "checkpoints are written by the monolithic and disaggregated layouts; "
               "the reference layout is for comparisons (set checkpoint.every=0)")
    elif t.resume not in ("auto", "none"):
        _check(Path(t.resume).is_dir(), src, "train.resume", f"{t.resume} is not a directory (expected auto, none or a checkpoint step directory)")
    if t.init_from:
        _check((Path(t.init_from) / "manifest.json").is_file(), src, "train.init_from",
               f"{t.init_from} is not a checkpoint step directory (no manifest.json)")


def check_data(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``data`` against the model: image sizes by patch, images and audio only for encoders that read them,
    generation targets for the generators there are (their VAEs, query tokens, sources that name a
    target's generator)."""
    d = r.data
    _check(d.seq_len >= 16, src, "data.seq_len", f"must be >= 16, got {d.seq_len}")
    images = [n for n in graph.encoders if module_family(r, n).modality == "image"]
    for name in images:
        patch = module_config(r, name).patch_size
        for s in d.image_sizes:
            _check(s > 0 and s % patch == 0, src, "data.image_sizes",
                   f"{s} is not a positive multiple of the patch size {patch} ({module_key(r, name)}.patch_size)")
    _check(bool(images) or d.max_images == 0, src, "data.max_images",
           f"must be 0: the model has no image encoder, got {d.max_images}")
    _check(not images or d.max_images >= 1 or d.source != "synthetic", src, "data.max_images",
           "must be >= 1: the synthetic source draws 1..max_images images for the image encoder")
    bad_graph = graph_problem(graph, lambda n: module_family(r, n).modality)
    _check(bad_graph is None, src, "model.modules", str(bad_graph))
    audio = [n for n in graph.encoders if module_family(r, n).modality == "audio"]
    _check(bool(audio) or d.max_audio == 0, src, "data.max_audio",
           f"must be 0: the model has no audio encoder, got {d.max_audio}")
    for name in audio:
        _check(d.source in AUDIO_SOURCES, src, "data.source",
               f"{module_key(r, name)} reads audio clips, which data.source {', '.join(AUDIO_SOURCES)} produce; got {d.source}")
        _check(d.max_audio >= 1, src, "data.max_audio",
               f"must be >= 1: {module_key(r, name)} reads up to max_audio clips per sequence")
        top = module_config(r, name).max_frames
        _check(d.audio_frames[-1] <= top, src, "data.audio_frames",
               f"clips of up to {d.audio_frames[-1]} frames exceed {module_key(r, name)}.max_frames {top}")
    gen = module_config(r, graph.generators[0]) if graph.generators else None
    _check(gen is not None or d.gen_prob == 0, src, "data.gen_prob",
           f"must be 0: the model has no generator, got {d.gen_prob}")
    bad = data_problem(d, gen.query_tokens if gen is not None else 1)
    if bad:
        raise ConfigError(f"{src}: 'data.{bad[0]}' {bad[1]}")
    # Real images give RGB generation targets: a latent-space generator needs its VAE (check_vae).
    for i, name in enumerate(graph.generators):
        cfg = module_config(r, name)
        check_vae(r, name, cfg, src)
        _check(i == 0 or not cfg.vae.enabled, src, f"{module_key(r, name)}.vae.preset",
               f"a frozen VAE encodes the first generator's targets only ({graph.generators[0]}), not {name}'s")
        bad = data_problem(d, cfg.query_tokens)
        if bad:
            raise ConfigError(f"{src}: 'data.{bad[0]}' {bad[1]} ({module_key(r, name)}.query_tokens)")
    # Each generator has its own query token and targets (SpecialTokens.query, PackedSample.targets):
    # the synthetic source draws targets for every generator, records name theirs (``generate``).
    _check(len(graph.generators) <= 1 or d.source in MULTI_GEN_SOURCES, src, "data.source",
           f"{d.source} gives generation targets to one generator only; the generators "
           f"{', '.join(graph.generators)} need data.source {' | '.join(MULTI_GEN_SOURCES)} "
           f"(records name a target's generator in their generate field, docs/data.md)")


def check_weights(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """``model.<module>.checkpoint`` paths exist, something trains, and a frozen module whose projector
    trains is one pipeline stage."""
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


def check_deepspeed(r: Recipe, graph: ModuleGraph, src: str) -> None:
    """Every engine's DeepSpeed JSON reads and passes its checks."""
    for name in graph.names:
        mp = module_parallel(r, name)
        path = mp.ds_config or r.deepspeed_config
        key = f"{parallel_key(r, name)}.ds_config" if mp.ds_config else "deepspeed_config"
        load_ds_config(require_file(path, key, src, r.source_file), key=key, recipe_src=src)


def check_eval(r: Recipe, src: str) -> None:
    """``eval``: sane counts, and a held-out share exactly where the data source needs one."""
    v = r.eval
    _check(v.every >= 0, src, "eval.every", f"must be >= 0 (0 turns evaluation off), got {v.every}")
    _check(v.batches >= 1, src, "eval.batches", f"must be >= 1, got {v.batches}")
    _check(0.0 <= v.holdout_fraction < 1.0, src, "eval.holdout_fraction", f"must be in [0, 1), got {v.holdout_fraction:g}")
    records = r.data.source in RECORD_SOURCES or r.data.source in SHARD_PATHS
    _check(records or v.holdout_fraction == 0, src, "eval.holdout_fraction",
           f"applies to record sources only; data.source {r.data.source} holds out a separate seed space (set it to 0)")
    _check(not records or v.every == 0 or v.holdout_fraction > 0, src, "eval.holdout_fraction",
           f"must be > 0 to evaluate on data.source {r.data.source} (e.g. 0.01 holds out 1% of the records)")


def check_vae(r: Recipe, name: str, gen, src: str) -> None:
    """A generator's ``vae``: a sane section, a readable checkpoint directory, and real images only
    for a pixel-space generator or one with a VAE (real sources make RGB targets)."""
    key, vae, d = f"{module_key(r, name)}.vae", gen.vae, r.data
    if vae.checkpoint:  # its config.json is the VAE's shape: read (and checked) first
        got = checkpoint_config(vae.checkpoint, f"{src}: '{key}.checkpoint'").get("latent_channels", 4)
        _check(got == gen.in_channels, src, f"{key}.checkpoint",
               f"{vae.checkpoint} has {got} latent channels, the generator's in_channels is {gen.in_channels}")
    bad = vae_problem(vae, gen.in_channels)
    if bad:
        raise ConfigError(f"{src}: '{key}.{bad[0]}' {bad[1]}")
    real = d.source in RECORD_SOURCES or d.source in SHARD_PATHS
    _check(not real or gen.in_channels == 3 or vae.enabled, src, f"{module_key(r, name)}.in_channels",
           f"data.source {d.source} produces RGB generation targets (3 channels), got {gen.in_channels}; "
           f"set {key}.preset (e.g. sd21) to encode them to latents, or use data.source=paper_stats or synthetic")
    _check(not vae.enabled or gen.in_channels != 3 or vae.checkpoint, src, f"{key}.preset",
           "a VAE needs a latent-space generator (in_channels = the VAE's latent channels), got in_channels 3")


def check_emulate(recipe, src: str) -> None:
    """One-line ``ConfigError`` for an ``emulate`` section that cannot run."""
    e = recipe.emulate
    if recipe.layout == "reference":
        raise ConfigError(f"{src}: 'emulate.enabled' needs layout monolithic or disaggregated "
                          "(the reference layout computes for real)")
    if not e.profile:
        if not e.tflops > 0:
            raise ConfigError(f"{src}: 'emulate.tflops' must be > 0 when 'emulate.profile' is empty, "
                              f"got {e.tflops}")
        return
    path = require_file(e.profile, "emulate.profile", src, recipe.source_file)
    profile = load_profile(path)  # ProfileError (a ConfigError) names the field and the file
    for name, (_, _, tp, _, _) in module_degrees(recipe).items():
        if name not in profile.modules:
            raise ConfigError(f"{src}: 'emulate.profile' {e.profile} has no module {name!r} (it profiles "
                              f"{', '.join(profile.modules)}; profile this recipe's modules)")
        if tp not in profile.modules[name].cost_ms:
            raise ConfigError(f"{src}: 'emulate.profile' {e.profile} has no modules.{name}.cost_ms "
                              f"for tp={tp}")
