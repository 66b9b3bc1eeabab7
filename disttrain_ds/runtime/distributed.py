"""``layout: disaggregated`` and ``layout: monolithic``: one pipeline engine per module.

Reads top to bottom: start processes -> rank map -> this rank's engine and boundary links -> run
directory -> the shared ``Trainer`` (``runtime/trainer.py``) with the pipeline step executor
(``runtime/pipeline_step.py``: this rank's microbatches through the shared 1F1B schedule, figures
gathered from every rank) and the callbacks (``runtime/callbacks/``).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as tdist

from disttrain_ds.checkpoint.engine import install as install_safe_checkpoint_engine
from disttrain_ds.checkpoint.lock import hold
from disttrain_ds.checkpoint.manifest import checkpoint_root
from disttrain_ds.checkpoint.steps import Checkpointer, resolve_resume
from disttrain_ds.comm.boundary import BoundaryComm, boundary_links
from disttrain_ds.comm.p2p import P2P, PeerInfo, edge_channels, waiting_on
from disttrain_ds.console import Console, tell_launcher
from disttrain_ds.data.config import SHARD_PATHS, longest_seq
from disttrain_ds.data.host_read import (
    EMULATED_HOSTS_ENV,
    aligned_parts,
    host_names,
    plan_reading,
    rank_positions,
    reader_classes,
    replica_hosts,
)
from disttrain_ds.data.spool import default_base, host_key, plan_shares
from disttrain_ds.errors import ConfigError
from disttrain_ds.estimate.memory_check import startup_memory_problem
from disttrain_ds.mllm.flex_warmup import warm_up_items, warm_up_stage
from disttrain_ds.models.channels_last import to_channels_last
from disttrain_ds.models.compiled import compile_enabled, compile_layers
from disttrain_ds.models.configs import trains
from disttrain_ds.parallel.engine import make_engine
from disttrain_ds.parallel.groups import META, ProcessGroups, plan_groups
from disttrain_ds.parallel.pipeline_module import build_pipeline_module
from disttrain_ds.parallel.roles import ROLES
from disttrain_ds.parallel.sequence_parallel import SPContext
from disttrain_ds.parallel.tensor_parallel import TPContext, full_state
from disttrain_ds.parallel.tp_sequence import TPSeqContext
from disttrain_ds.recipe.deepspeed import engine_config, load_ds_config
from disttrain_ds.recipe.graph import sliced_tp_chunks, topology_of
from disttrain_ds.recipe.schema import Recipe, resolve_path
from disttrain_ds.reorder.host_order import HostOrder
from disttrain_ds.runtime.callbacks.balance import Balance
from disttrain_ds.runtime.callbacks.checkpoint import Checkpointing
from disttrain_ds.runtime.callbacks.emulation import EmulationRecords
from disttrain_ds.runtime.callbacks.evaluation import Evaluation
from disttrain_ds.runtime.callbacks.guard import NonFiniteGuard
from disttrain_ds.runtime.callbacks.health import Heartbeat
from disttrain_ds.runtime.callbacks.metrics import MetricsLog, open_pipeline_run
from disttrain_ds.runtime.callbacks.preemption import FaultInjection, PreemptionStop, stop_line
from disttrain_ds.runtime.callbacks.trace import TraceWriter
from disttrain_ds.runtime.emulate import Emulator
from disttrain_ds.runtime.health import Watchdog, connect_store
from disttrain_ds.runtime.pipeline_step import PipelineExecutor
from disttrain_ds.runtime.placement import Placement
from disttrain_ds.runtime.preempt import EXIT_PREEMPTED, Preemption
from disttrain_ds.runtime.rank_context import RankContext
from disttrain_ds.runtime.setup import (
    build_data_and_spec,
    build_eval_source,
    build_optimizer,
    grad_accum_steps,
    lr_lambda,
    param_groups,
)
from disttrain_ds.runtime.startup import init_processes, nccl_timeout_s
from disttrain_ds.runtime.trainer import Trainer
from disttrain_ds.schedule.onef1b import StagePlace
from disttrain_ds.topology import Topology


def needs_backward(recipe: Recipe, topo: Topology) -> dict[str, bool]:
    """A module runs backward if it or anything upstream of it trains."""
    return topo.graph.runs_backward({m.name: trains(recipe.model.modules[m.name]) for m in topo.modules})


def rank_name(m, rank: int) -> str:
    """'llm stage 0 dp 1' (plus 'tp 1' with tensor parallelism): how logs and errors name a rank."""
    stage, dp, tp = m.coords(rank)
    return f"{m.name} stage {stage} dp {dp}" + (f" tp {tp}" if m.tp > 1 else "")


def tp_context(grid, groups: ProcessGroups, tp_index: int) -> TPContext:
    """This rank's tensor-parallel group (the module's "model" axis, made by every rank)."""
    ranks, group = groups.module_axes(grid.name)["model"]
    return TPContext(group if grid.tp > 1 else None, tp_index, grid.tp, ranks[0])


def tp_seq_context(recipe: Recipe, grid, tp: TPContext, device: torch.device) -> TPSeqContext | None:
    """Sequence-sharded, overlapped TP for this rank's module where ``tp_overlap`` turns it on."""
    chunks = sliced_tp_chunks(recipe, grid.name, grid.tp, device.type == "cuda")
    return TPSeqContext(tp, chunks) if chunks else None


def sp_context(grid, groups: ProcessGroups, rank: int) -> SPContext | None:
    """This rank's sequence-parallel group (made by every rank where SP > 1), None without SP."""
    found = groups.seq_group(grid.name)
    if found is None:
        return None
    ranks, group = found
    return SPContext(group, grid.sp_index(rank), grid.sp, ranks[0])


def boundary_tensor(spec, module: str, down: str, recipe: Recipe) -> tuple[str, tuple[int, ...], torch.dtype]:
    """What ``module`` sends to ``down``: its rows key, the trailing dims of a row, and dtype."""
    role = ROLES[spec.roles[module]](spec, module)
    dtype = torch.bfloat16 if recipe.train.dtype == "bf16" else torch.float32
    return role.rows_key(down), role.boundary_features(down), dtype


def gather_hosts(world: int, group) -> tuple[list[str], list[int], str]:
    """Every rank's host name (its machine, or ``DISTTRAIN_EMULATED_HOSTS``' name for it) and pid,
    and one token for this launch."""
    hosts: list = [None] * world
    tdist.all_gather_object(hosts, (host_key(), os.getpid(), secrets.token_hex(8)), group=group)
    names = host_names([h for h, _, _ in hosts], os.environ.get(EMULATED_HOSTS_ENV))
    return names, [pid for _, pid, _ in hosts], hosts[0][2]


def share_batches(recipe: Recipe, source, rank: int, world: int, hosts: tuple[list[str], list[int], str]) -> None:
    """``data.share: node``: ranks on one host read the batches its leader's producers write once."""
    if not recipe.data.producers or recipe.data.share != "node" or world == 1:
        return
    names, pids, token = hosts
    base = Path(recipe.data.spool_dir).expanduser() if recipe.data.spool_dir else default_base()
    share = plan_shares(list(zip(names, pids)), token, base)[rank]
    if os.environ.get(EMULATED_HOSTS_ENV):  # emulated hosts share one machine: a spool each
        share = dataclasses.replace(share, directory=share.directory.with_name(
            f"{share.directory.name}-{sorted(set(names)).index(names[rank])}"))
    source.share_with(share)


def read_by_host(recipe: Recipe, topo: Topology, source, rank: int, names: list[str], group,
                 log=print) -> list[int] | None:
    """``data.read: host`` (or ``auto``) on several hosts: this host reads only its ranks' samples;
    returns the positions this rank counts in batch-wide sums (None: every host reads whole
    batches). Under ``auto`` a job that cannot read per host reads whole batches, and rank 0 says why.
    With ``data.reorder`` the hosts exchange sample costs over ``group`` and reorder each batch
    keeping every sample on its host (``reorder/host_order.py``)."""
    d = recipe.data
    if d.read == "all" or len(set(names)) == 1:
        return None
    where = recipe.source_file
    batch, slot = recipe.train.global_batch, recipe.parallel.llm.dp * recipe.train.micro_batch
    consumed = rank_positions(topo.modules, slot, batch)
    units = source.inner.units()
    why = None
    if any(m.sp_auto for m in topo.modules):
        why = ("adaptive SP (sp: auto) groups each microbatch's samples across replicas by their lengths",
               "set data.read=all")
    elif units is None and d.source not in SHARD_PATHS:
        why = (f"data.source {d.source} reads each global batch as one stream, so every host would read all of it",
               "set data.read=all, or use webdataset / parquet / folder / hf with data.shard_parts")
    plan = None
    if why is None:
        try:
            plan = plan_reading(units or [list(range(batch))], names, consumed, batch)
        except ValueError as exc:
            fits = aligned_parts(batch, slot, source.shape.columns, names, consumed)
            hint = f"; {fits} parts would" if fits else ""
            why = (f"data.shard_parts {d.shard_parts} part{'s' if d.shard_parts > 1 else ''} do not fall on whole "
                   f"hosts ({exc}){hint}", "or set data.read=all")
    if why is not None:
        if d.read == "host" and why[0].startswith("data.shard_parts"):
            raise ConfigError(f"{where}: 'data.shard_parts' {why[0].removeprefix('data.shard_parts ')}, {why[1]}")
        if d.read == "host":
            raise ConfigError(f"{where}: 'data.read' host: {why[0]}; {why[1]}")
        if rank == 0:
            log(f"data.read auto: every host reads whole global batches ({why[0]})")
        return None
    source.read_only(plan.units[names[rank]])
    if d.reorder:
        source.order_with(HostOrder(source.shape, source.special, reader_classes(names, consumed, batch),
                                    plan.positions_of(rank), group))
    return plan.positions_of(rank)


def layer_state(pm, module: str, layer_defs, tp: TPContext) -> dict[str, torch.Tensor]:
    """This rank's parameters keyed ``module/layer/param`` (same keys as ``reference_layer_state``),
    tensor-parallel shards gathered back to full tensors."""
    out = {}
    for idx in range(pm._local_start, pm._local_stop):
        layer = getattr(pm, str(idx))
        for k, v in full_state(layer, tp).items():
            out[f"{module}/{layer_defs[idx].name}/{k}"] = v.detach().cpu().clone()
    return out


def train_distributed(recipe: Recipe, log=print, export_dir: str | None = None, console: Console | None = None,
                      memory_rows: list | None = None) -> int:
    """Train; with ``export_dir`` every rank also saves its final layer parameters there.
    ``memory_rows``: the memory estimate already checked before start-up (``memory.estimate``), held
    on GPUs against what each device has free once its groups exist.

    With ``console`` (``Console.start``), rank 0's own lines go to its terminal through
    ``console.say`` and library output to ``<run dir>/logs/rank<N>.log``. A failure on any rank
    stops every rank within ``parallel.heartbeat_timeout_s`` (plus a few seconds) with one line
    naming the failed rank and its module (``runtime/health.py``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    preempt = Preemption(recipe.checkpoint.sigterm_grace_s).install()  # SIGTERM: save at the next step, stop
    topo = topology_of(recipe)
    topo.check_world(world, recipe.source_file)
    resume_from, manifest = resolve_resume(recipe, world)
    device = init_processes(recipe.parallel.comm_timeout_s, recipe.parallel.startup_timeout_s)
    rank = tdist.get_rank()
    names = {r: rank_name(m, r) for m in topo.modules for r in m.ranks}
    console = console or Console(rank, sys.stdout)
    if console.log_path is not None:
        log = console.say

    def emit(line: str) -> None:  # failure lines: terminal, naming the library log until it moves
        print(line + console.note(), file=sys.stderr, flush=True)
        tell_launcher(line)

    watchdog = Watchdog(connect_store(), rank, names, recipe.parallel.heartbeat_timeout_s,
                        startup_timeout_s=recipe.parallel.startup_timeout_s, emit=emit,
                        console=console).start()  # console: lines not shown go to its run-dir log
    job = JobStart(recipe, topo, world, rank, device, names, watchdog, resume_from, manifest, log, export_dir,
                   console, preempt, memory_rows)
    try:
        if rank == 0 and recipe.checkpoint.every > 0:  # one job writes (and prunes) a checkpoint directory
            job.held.append(hold(checkpoint_root(recipe), "checkpoint.dir", recipe.checkpoint.lock_timeout_s, log))
        rc = _train(job)
    except BaseException as exc:  # noqa: BLE001 - every failure ends in one line, on every rank
        watchdog.handle(exc, recipe.parallel.heartbeat_timeout_s + 5)
        raise
    finally:
        for lock in job.held:
            lock.release()
    preempt.handled()
    watchdog.finished()
    tdist.destroy_process_group()
    return rc


@dataclass
class JobStart:
    """What a rank knows once its processes are up, before the job's groups exist."""

    recipe: Recipe
    topo: Topology
    world: int
    rank: int
    device: torch.device
    names: dict[int, str]
    """Each rank's name in messages (module and coordinates)."""
    watchdog: Watchdog
    resume_from: Path | None
    """The checkpoint this run resumes from (None: a fresh start)."""
    manifest: dict | None
    """Its manifest."""
    log: Callable[[str], None]
    export_dir: str | None
    """Where every rank saves its final layer parameters (tests), or None."""
    console: Console
    preempt: Preemption
    memory_rows: list | None
    """The memory estimate checked before start-up, held against each GPU's free memory."""
    held: list = field(default_factory=list)
    """This job's directory locks (rank 0), released when the job ends, however it ends."""


def _train(job: JobStart) -> int:
    recipe, topo, world, rank, device, names = job.recipe, job.topo, job.world, job.rank, job.device, job.names
    watchdog, resume_from, manifest, log, console, preempt = (job.watchdog, job.resume_from, job.manifest, job.log,
                                                               job.console, job.preempt)
    is_logger = rank == 0
    if is_logger:
        log(topo.describe())
        for m in topo.modules:
            if chunks := sliced_tp_chunks(recipe, m.name, m.tp, device.type == "cuda"):
                log(f"{m.name}: tensor parallelism on sequence slices, collectives overlapped in {chunks} chunks")

    source, spec = build_data_and_spec(recipe)
    if hasattr(source, "stall_timeout_s"):  # a stopped producer is caught within the heartbeat timeout
        source.stall_timeout_s = recipe.parallel.heartbeat_timeout_s
    grid = topo.module_of(rank)
    stage, dp_index, tp_index = grid.coords(rank)
    slot = recipe.parallel.llm.dp * recipe.train.micro_batch
    backward = needs_backward(recipe, topo)

    # Every rank makes every group of the job, in one order (eager NCCL splits them off the world):
    # the gloo bookkeeping group for step figures, one group per boundary channel (per graph edge
    # and direction, apart from DeepSpeed's own P2P), and every module's grid groups.
    groups = ProcessGroups(rank).make(plan_groups(topo.modules, world, spec.tied_modules(), topo.edges),
                                      nccl_timeout_s(recipe.parallel.comm_timeout_s))
    meta_group = groups.get((META,))
    channels = {ch: groups.get(("channel", ch)) for ch in edge_channels(topo.edges) if ("channel", ch) in groups.handles}
    p2p = P2P(channels, rank, device, recipe.parallel.comm_timeout_s, PeerInfo(names))
    watchdog.heart.waiting = waiting_on  # beats say whom a blocked transfer waits for
    hosts = gather_hosts(world, meta_group)
    share_batches(recipe, source, rank, world, hosts)
    counted = read_by_host(recipe, topo, source, rank, hosts[0], meta_group, log)
    tp = tp_context(grid, groups, tp_index)
    sp = sp_context(grid, groups, rank)
    up_grids, down_grids = topo.upstreams(grid.name), topo.downstreams(grid.name)
    upstreams = [BoundaryComm(p2p, up, grid, slot, *boundary_tensor(spec, up.name, grid.name, recipe), tp,
                              backward[up.name]) for up in up_grids] if stage == 0 else []  # one per graph edge
    downstreams = [BoundaryComm(p2p, grid, down, slot, *boundary_tensor(spec, grid.name, down.name, recipe), tp)
                   for down in down_grids] if stage == grid.pp - 1 else []  # the LLM: one per generator
    # Post-balancing and adaptive SP may route any sample between any two replicas of an edge.
    every_pair = recipe.parallel.post_balance or any(m.sp_auto for m in topo.modules)
    p2p.connect(boundary_links(topo.modules, slot, backward, topo.edges, every_pair=every_pair))
    check_free_memory(recipe, job.memory_rows, rank, device)  # after NCCL's set-up, before the weights
    mp = recipe.parallel.modules[grid.name]
    pm = build_pipeline_module(grid, spec.layers(grid.name), mp.partition, tp, groups.module_axes(grid.name),
                               mp.activation_checkpointing, groups.tied_group(grid.name), sp,
                               tp_seq_context(recipe, grid, tp, device))
    if recipe.train.dtype == "bf16":
        pm.to(torch.bfloat16)
    if device.type == "cuda" and spec.family(grid.name).channels_last:
        to_channels_last(pm)
    if compile_enabled(recipe.train.compile, device):  # in place: names, checkpoints and export unchanged
        compile_layers(getattr(pm, str(i)) for i in range(pm._local_start, pm._local_stop))
    frozen = not any(p.requires_grad for p in pm.parameters())  # this stage holds nothing to train
    place = StagePlace(
        total_stages=topo.total_stages,
        global_stage=topo.stage_offset(grid.name) + stage,
        first_of_engine=stage == 0,
        last_of_engine=stage == grid.pp - 1,
        has_upstream=bool(up_grids),
        has_downstream=bool(down_grids),
        backward=backward[grid.name],
        upstream_backward=any(backward[up.name] for up in up_grids),
    )
    ctx = RankContext(recipe, topo, rank, world, device, names, grid, stage, dp_index, tp_index, place, groups,
                      meta_group, tp, p2p, per_node=min(Counter(hosts[0]).values()))

    engine = _engine(ctx, spec, pm, upstreams, downstreams, frozen, sp)
    # Compiled kernels (flex attention) are built now, not inside step 1 under the step's deadlines;
    # the broadcast below is the last start-up collective, so no rank's step waits on a compile.
    # Every length the data makes (multiples of seq_len up to max_seq_len).
    for length in range(recipe.data.seq_len, longest_seq(recipe.data) + 1, recipe.data.seq_len):
        warm_up_stage(pm, batch=slot // grid.dp, seq_len=length, device=device, tp=grid.tp, sp=grid.sp,
                      backward=place.backward)
    warm_up_items(pm, device, backward=place.backward)  # encoder blocks' attention over packed items

    ckpt = Checkpointer(recipe, engine, grid.name, rank, world, meta_group, log=log)
    start = 0
    if resume_from is not None:
        # Verified before loading; under resume: auto a damaged one gives way to the newest intact one.
        resume_from, manifest = ckpt.resume(resume_from, source)
        start = manifest["step"]

    run_dir = writer = mfu = None
    if is_logger:
        run_dir, writer, mfu, run_lock = open_pipeline_run(recipe, topo, world, device, spec, source,
                                                           (resume_from, manifest, start), log, console.terminal)
        job.held.append(run_lock)
    dirs = [str(run_dir) if is_logger else None]
    tdist.broadcast_object_list(dirs, src=0, group=meta_group)
    watchdog.failure_dir = dirs[0]
    console.move_to(dirs[0])

    homes = replica_hosts(topo.modules, hosts[0]) if counted is not None else None
    executor = PipelineExecutor(ctx, spec, engine, preempt, counted, homes)
    callbacks = _callbacks(ctx, executor.placement, engine, ckpt, watchdog, preempt, writer, mfu, dirs[0])
    trainer = Trainer(recipe, source, executor, callbacks, start, echo=writer.echo if writer else None)
    trainer.fit()
    if job.export_dir and not trainer.preempted:
        state = layer_state(pm, grid.name, spec.layers(grid.name), tp)
        torch.save(state, os.path.join(job.export_dir, f"params_rank{rank}.pt"))
    tdist.barrier(group=meta_group)
    source.release_spool()  # every rank of the host is past its last batch (a relaunch reads on from the checkpoint)
    if is_logger:
        writer.close()
        log(stop_line(trainer) if trainer.preempted else f"metrics: {run_dir / 'metrics.jsonl'}")
    return EXIT_PREEMPTED if trainer.preempted else 0


def check_free_memory(recipe: Recipe, rows: list | None, rank: int, device: torch.device) -> None:
    """On a GPU, the estimate plus what is still to come against what the device has free now."""
    if device.type != "cuda" or rows is None:
        return
    free, total = torch.cuda.mem_get_info(device)
    problem = startup_memory_problem(recipe, rows, rank, free, total)
    if problem:
        raise ConfigError(problem)


def _engine(ctx: RankContext, spec, pm, upstreams, downstreams, frozen: bool, sp: SPContext | None = None):
    """This stage's ``ModuleEngine``: optimizer and LR schedule unless frozen, the module's DeepSpeed
    config completed for its DP and accumulation, boundary links, emulated compute if asked."""
    recipe, grid = ctx.recipe, ctx.grid
    optimizer = scheduler = None
    if not frozen:
        defs = spec.layers(grid.name)
        local = [(defs[i].name, getattr(pm, str(i))) for i in range(pm._local_start, pm._local_stop)]
        optimizer = build_optimizer(recipe, param_groups(recipe, grid.name, local))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))
    mp = recipe.parallel.modules[grid.name]
    base = load_ds_config(resolve_path(mp.ds_config or recipe.deepspeed_config))
    micro = ctx.slot // grid.dp
    cfg = engine_config(
        base, micro_batch=micro, grad_accum=grad_accum_steps(recipe), dp=grid.data_size, dtype=recipe.train.dtype,
        grad_clip=recipe.optim.grad_clip, frozen=frozen,
    )
    engine = make_engine(pm, optimizer, scheduler, cfg, install_safe_checkpoint_engine)
    engine.setup_disaggregated(ROLES[spec.roles[grid.name]](spec, grid.name, sp), ctx.place, upstreams, downstreams,
                               frozen)
    if recipe.emulate.enabled:
        engine.emulator = Emulator.for_rank(recipe, ctx.topo, ctx.rank, spec, ctx.place.backward, ctx.per_node)
    return engine


def _callbacks(ctx: RankContext, placement: Placement, engine, ckpt, watchdog, preempt, writer, mfu,
               run_dir: str) -> list:
    """The loop's concerns on this rank, in the order they see each step (metrics on rank 0 only)."""
    recipe, rank = ctx.recipe, ctx.rank
    callbacks = [Heartbeat(watchdog)]
    if recipe.eval.every > 0:
        callbacks.append(Evaluation(recipe, build_eval_source(recipe)))
    if writer is not None:
        callbacks += [Balance(placement),
                      MetricsLog(recipe, placement.spec.special.pad, writer, mfu, writer.echo)]
    callbacks += [NonFiniteGuard(recipe.train.on_nonfinite), PreemptionStop(preempt), Checkpointing(ckpt, run_dir),
                  TraceWriter(engine, ctx.meta_group, run_dir, rank, ctx.label)]
    if engine.emulator is not None:
        callbacks.append(EmulationRecords(engine.emulator, run_dir, rank))
    return callbacks + [FaultInjection(rank)]
