"""One DeepSpeed pipeline engine per module, on that module's ranks, in a shared world.

``ModuleEngine`` is a ``PipelineEngine``: DeepSpeed still owns the optimizer, ZeRO-1, bf16,
gradient accumulation, DP all-reduce, intra-engine P2P and checkpoint files. What changes:
- the grid lives on the module's rank subset (``grid.SubsetGrid``);
- the instruction stream comes from the one global 1F1B schedule (``schedule.engine_schedule``);
- the engine's first stage takes its input from the upstream engines (one boundary per graph
  edge: the LLM reads every encoder) and returns each one its input gradient; its last stage
  computes its own loss (if any), sends each downstream engine its output (the LLM: each generator
  the states at its own query positions) and, in backward, adds the downstream gradients through
  the surrogate ``sum_k <output_k, grad_k>``;
- losses are kept per pipe buffer, since a last stage that is not the global last stage runs
  several forwards before the matching backwards.
"""

from __future__ import annotations

import functools
import time
from dataclasses import is_dataclass, replace
from types import MethodType
from typing import Callable

import torch
import torch.distributed as tdist
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from disttrain_ds.comm.boundary import BoundaryComm
from disttrain_ds.comm.p2p import waiting_for
from disttrain_ds.mllm.model import MicroBatch
from disttrain_ds.parallel.roles import Role
from disttrain_ds.schedule.onef1b import (
    BoundaryRecvActivation,
    BoundaryRecvGrad,
    BoundarySendGrad,
    LoadData,
    StagePlace,
    engine_schedule,
    eval_schedule,
    num_buffers,
)
from disttrain_ds.schedule.timeline import write_trace_events


def _to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return tuple(_to_device(t, device) for t in x)


class ModuleEngine(PipelineEngine):
    """A pipeline engine that is one module of a disaggregated (or monolithic) MLLM."""

    emulator = None  # runtime.emulate.Emulator when the recipe's emulate.enabled is set

    def setup_disaggregated(
        self,
        role: Role,
        place: StagePlace,
        upstreams: list[BoundaryComm],
        downstreams: list[BoundaryComm],
        frozen: bool,
    ) -> None:
        """``upstreams``: this stage's boundaries to the engines feeding it, in the order their
        tensors enter the first stage (``role.boundary_input_indices``); ``downstreams``: the last
        stage's boundaries to the engines it feeds, in the order of ``role.boundary_outputs``;
        empty elsewhere."""
        self.role, self.place, self.upstreams, self.downstreams = role, place, upstreams, downstreams
        self.frozen = frozen
        self.fixed_sp = role.sp  # parallel.<module>.sp > 1: one group for every microbatch
        self.sp_groups: list | None = None  # sp: auto: this rank's SPContext (or None) per microbatch
        self._steps = engine_schedule(self.micro_batches, place)
        self._reserve_pipe_buffers(num_buffers(self.micro_batches, place))
        self.extra = {k: [None] * self.num_pipe_buffers for k in ("mb", "loss", "out", "out_grad", "recv")}

    # ---- one optimizer step -------------------------------------------------------------
    def run_step(self, batches: list[MicroBatch]) -> dict:
        """Execute this stage's part of one optimizer step over ``batches`` (one per microbatch)."""
        self.module.train()
        return self._run(batches)

    def run_eval(self, batches: list[MicroBatch]) -> dict:
        """This stage's forward passes over ``batches`` (``eval_schedule``): no gradients, no
        optimizer step, emulated compute off; ``own_loss`` as in ``run_step``. Every engine of the
        job calls it for the same batches."""
        saved = self.place, self._steps, self.emulator, getattr(self, "trace", [])
        self.place = replace(self.place, backward=False, upstream_backward=False)
        self._steps, self.emulator = eval_schedule(self.micro_batches, self.place), None
        try:
            with torch.no_grad():
                return self._run(batches)
        finally:
            self.place, self._steps, self.emulator, self.trace = saved
            for key in self.extra:  # nothing of the evaluation stays referenced
                self.extra[key] = [None] * self.num_pipe_buffers

    def _run(self, batches: list[MicroBatch]) -> dict:
        assert len(batches) == self.micro_batches
        self.batches = batches
        self._next_fwd = self._next_bwd = 0
        self.stats = {"own_loss": 0.0, "compute_s": 0.0}
        for comm in self._comms():
            comm.wait_seconds = 0.0
        if self.place.first_of_engine:
            for comm in self.upstreams:
                comm.prefetch_activation(0, self._rows(comm, 0))
        self.trace: list[dict] = []  # this step's spans, for the per-rank timeline
        for step_cmds in self._steps:
            for cmd in step_cmds:
                fn = self._DISAGG_MAP.get(type(cmd))
                if fn is None:
                    raise RuntimeError(f"{type(self).__name__} does not understand {cmd!r}")
                fwd_side = (ds.ForwardPass, LoadData, BoundaryRecvActivation, ds.RecvActivation)
                mb = self._next_fwd if isinstance(cmd, fwd_side) else None
                t0 = time.perf_counter()
                MethodType(fn, self)(**cmd.kwargs)
                buf = cmd.kwargs.get("buffer_id")
                if mb is None and buf is not None:
                    mb = self.extra["mb"][buf]
                self.trace.append({"name": _SPAN_NAMES.get(type(cmd), type(cmd).__name__), "mb": mb,
                                   "start": t0, "end": time.perf_counter()})
        self.p2p_flush()
        comm_wait = sum(c.wait_seconds for c in self._comms())
        return {**self.stats, "comm_wait_s": comm_wait}

    def _rows(self, comm: BoundaryComm, mb: int) -> list[int]:
        """Per-sample rows of ``comm``'s boundary tensor in microbatch ``mb``: both ends know them
        (none where this rank is an adaptive SP group's member: its lead talks for the group)."""
        if self._member(mb):
            return []
        return self.batches[mb].sample_rows[comm.rows_key]

    def _member(self, mb: int) -> bool:
        """This rank is in an adaptive SP group of microbatch ``mb`` and is not its lead."""
        return self.sp_groups is not None and self.sp_groups[mb] is not None and not self.sp_groups[mb].is_lead

    def _use_groups(self, mb: int) -> None:
        """Adaptive SP: the layers and the role take microbatch ``mb``'s group (autograd keeps it for backward)."""
        if self.sp_groups is None:
            return
        self.role.sp = self.sp_groups[mb]
        for m in self.module.modules():
            if hasattr(m, "seq_parallel"):
                m.seq_parallel = self.role.sp

    def _comms(self) -> list[BoundaryComm]:
        return [*self.upstreams, *self.downstreams]

    def p2p_flush(self) -> None:
        for comm in self._comms()[:1]:  # one P2P serves every boundary of the rank
            comm.p2p.flush_sends()

    # ---- instructions -----------------------------------------------------------------------
    def _exec_boundary_recv_activation(self, buffer_id: int) -> None:
        mb = self._next_fwd
        acts = []
        for comm in self.upstreams:
            act = comm.recv_activation(mb, self._rows(comm, mb))
            if mb + 1 < self.micro_batches:
                comm.prefetch_activation(mb + 1, self._rows(comm, mb + 1))
            if comm.backward:
                act.requires_grad_(True)
            acts.append(act)
        self.extra["recv"][buffer_id] = acts

    def _exec_load_data(self, buffer_id: int) -> None:
        mb = self._next_fwd
        self.extra["mb"][buffer_id] = mb
        batch = self.batches[mb]
        if self.place.first_of_engine:
            inputs = self.role.first_inputs(batch, self.extra["recv"][buffer_id] or [])
            self.pipe_buffers["inputs"][buffer_id] = _to_device(inputs, self.device)
            self.extra["recv"][buffer_id] = None

    def _exec_forward(self, buffer_id: int) -> None:
        t0 = time.perf_counter()
        mb = self._next_fwd
        self._next_fwd += 1
        self.extra["mb"][buffer_id] = mb
        inputs = self.pipe_buffers["inputs"][buffer_id]
        self._use_groups(mb)
        if self._member(mb) and self.place.first_of_engine:  # placeholders of the lead's rows, filled by from_lead
            inputs = list(inputs)
            for comm, i in zip(self.upstreams, self.role.boundary_input_indices):
                rows = sum(self.batches[mb].sample_rows[comm.rows_key])
                inputs[i] = inputs[i].new_zeros((rows, *inputs[i].shape[1:])).requires_grad_(inputs[i].requires_grad)
            inputs = tuple(inputs)
        # Clones keep the received leaves (whose .grad we send back) out of in-place ops; under SP
        # the SP lead's received tensors are broadcast to its group instead (a copy too).
        shared = self.role.boundary_input_indices if self.role.sp is not None and self.place.first_of_engine else ()
        inputs = (tuple(self.role.sp.from_lead(t) if i in shared else t.clone() for i, t in enumerate(inputs))
                  if isinstance(inputs, tuple) else inputs.clone())
        with torch.set_grad_enabled(self.place.backward):
            if self.optimizer is None or not self.place.backward:
                # Frozen or evaluating: DeepSpeed's forward hooks insist on engine.backward(), which needs an optimizer.
                outputs = self.module(inputs)
            else:
                outputs = DeepSpeedEngine.forward(self, inputs)  # PipelineEngine.forward is disabled
        self.pipe_buffers["outputs"][buffer_id] = outputs
        if self.emulator is not None:  # emulated compute: the output exists once its modelled time is up
            self.emulator.wait("fwd", mb, t0)
        if self.place.last_of_engine:
            batch = _to_device_mb(self.batches[mb], self.device)
            loss = self.role.own_loss(outputs, batch)
            out = self.role.boundary_outputs(outputs, batch)
            if loss is not None:  # under SP each rank reports its slice's share (its loss carries the factor)
                self.stats["own_loss"] += float(loss.detach()) / (self.role.sp.grad_factor if self.role.sp else 1)
            if len(out) != len(self.downstreams):
                raise RuntimeError(f"{len(out)} boundary outputs for {len(self.downstreams)} downstream engines")
            for comm, tensor in zip(self.downstreams, out):  # disjoint ranks: each pair keeps microbatch order
                if self._member(mb):
                    continue  # the group's lead sends the group's rows
                rows = self._rows(comm, mb)
                comm.send_activation(mb, tensor.detach(), rows)
                if self.place.backward:
                    comm.prefetch_grad(mb, rows)
            self.extra["loss"][buffer_id] = loss
            self.extra["out"][buffer_id] = out
        self.stats["compute_s"] += time.perf_counter() - t0

    def _exec_boundary_recv_grad(self, buffer_id: int) -> None:
        mb = self.extra["mb"][buffer_id]
        if self._member(mb):  # the lead injects the group's boundary gradients
            self.extra["out_grad"][buffer_id] = [torch.zeros_like(o) for o in self.extra["out"][buffer_id]]
            return
        self.extra["out_grad"][buffer_id] = [comm.recv_grad(mb, self._rows(comm, mb)) * comm.grad_scale
                                             for comm in self.downstreams]

    def _exec_backward(self, buffer_id: int) -> None:
        t0 = time.perf_counter()
        self._next_bwd += 1
        # Adaptive SP: a checkpointed block recomputed here must see its own microbatch's group.
        self._use_groups(self.extra["mb"][buffer_id])
        if self.place.last_of_engine:
            self._backward_last(buffer_id)
        elif self.optimizer is not None:
            PipelineEngine._exec_backward_pass(self, buffer_id)
        else:
            self._backward_plain(buffer_id)
        if self.emulator is not None:
            self.emulator.wait("bwd", self.extra["mb"][buffer_id], t0)
        self.stats["compute_s"] += time.perf_counter() - t0

    def _backward_last(self, buffer_id: int) -> None:
        loss, outs, grads = (self.extra[k][buffer_id] for k in ("loss", "out", "out_grad"))
        # Target: d/dθ of (own loss / accumulation steps + sum_k <out_k, g_k>); each g_k (from
        # downstream engine k) is already per-step. d<out_k, g_k>/d out_k = g_k puts it into this graph.
        gas = float(self.micro_batches)
        terms = []
        if loss is not None:
            terms.append(loss if self.optimizer is not None else loss / gas)
        for out, g in zip(outs or [], grads or []):
            # DeepSpeed's backward divides everything by the accumulation steps: pre-multiply.
            scale = gas if self.optimizer is not None else 1.0
            terms.append((out * g.to(out.dtype)).sum() * scale)
        total = sum(terms[1:], terms[0])
        if self.optimizer is None:
            total.backward()
        else:
            DeepSpeedEngine.backward(self, total)
        for k in ("loss", "out", "out_grad"):
            self.extra[k][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None

    def _backward_plain(self, buffer_id: int) -> None:
        """Backward of a frozen engine's inner stage: only input gradients are needed."""
        outputs = self.pipe_buffers["outputs"][buffer_id]
        outs = [t for t in outputs if t.is_floating_point()] if isinstance(outputs, tuple) else [outputs]
        grads = self.grad_layer if isinstance(self.grad_layer, (list, tuple)) else [self.grad_layer]
        torch.autograd.backward(outs, grads)
        self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_boundary_send_grad(self, buffer_id: int) -> None:
        mb = self.extra["mb"][buffer_id]
        inputs = self.pipe_buffers["inputs"][buffer_id]
        for comm, index in zip(self.upstreams, self.role.boundary_input_indices):
            if comm.backward:  # an upstream that runs no backward wants no gradient
                leaf = inputs[index]
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                comm.send_grad(mb, grad, self._rows(comm, mb))
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_reduce(self) -> None:
        if self.optimizer is not None:
            PipelineEngine._exec_reduce_grads(self)

    def _exec_reduce_tied(self) -> None:
        """Sum the gradients of the copies of a tied weight held by two stages (the embedding and
        the LM head), so both copies take the same step, as the one parameter of the reference does."""
        if self.optimizer is None:
            return
        for p in self.module.tied_copies:
            # DeepSpeed's bf16 optimizer accumulates in fp32 beside the weight (its own tied path reads it there).
            grad = getattr(p, "_hp_grad", None) if self.using_bf16_optimizer else p.grad
            if grad is None:  # the other copy's rank all-reduces regardless: never leave it waiting
                grad = torch.zeros_like(p)
                if not self.using_bf16_optimizer:
                    p.grad = grad  # the partner's gradient still reaches this copy
            tdist.all_reduce(grad, group=self.module.tied_group)

    def _exec_step(self, lr_kwargs=None) -> None:
        if self.optimizer is not None:
            PipelineEngine._exec_optimizer_step(self, lr_kwargs)

    _DISAGG_MAP = {
        ds.OptimizerStep: _exec_step,
        ds.ReduceGrads: _exec_reduce,
        ds.ReduceTiedGrads: _exec_reduce_tied,
        LoadData: _exec_load_data,
        ds.ForwardPass: _exec_forward,
        ds.BackwardPass: _exec_backward,
        ds.SendActivation: PipelineEngine._exec_send_activations,
        ds.RecvActivation: PipelineEngine._exec_recv_activations,
        ds.SendGrad: PipelineEngine._exec_send_grads,
        ds.RecvGrad: PipelineEngine._exec_recv_grads,
        BoundaryRecvActivation: _exec_boundary_recv_activation,
        BoundarySendGrad: _exec_boundary_send_grad,
        BoundaryRecvGrad: _exec_boundary_recv_grad,
    }


_SPAN_NAMES = {
    ds.ForwardPass: "forward",
    ds.BackwardPass: "backward",
    ds.SendActivation: "send",
    ds.SendGrad: "send",
    BoundarySendGrad: "send",
    ds.RecvActivation: "recv",
    ds.RecvGrad: "recv",
    BoundaryRecvActivation: "recv",
    BoundaryRecvGrad: "recv",
    LoadData: "load",
    ds.ReduceGrads: "allreduce",
    ds.ReduceTiedGrads: "allreduce",
    ds.OptimizerStep: "optimizer",
}


def write_trace(spans: list[dict], path: str, rank: int, label: str, origin: float) -> None:
    """One rank's spans of a step as Chrome-trace JSON (Perfetto / chrome://tracing)."""
    events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} {label}"}}]
    for sp in spans:
        events.append({
            "name": sp["name"], "ph": "X", "pid": rank, "tid": 0,
            "ts": (sp["start"] - origin) * 1e6, "dur": (sp["end"] - sp["start"]) * 1e6,
            "args": {"microbatch": sp["mb"]},
        })
    write_trace_events(events, path)


def _to_device_mb(mb: MicroBatch, device) -> MicroBatch:
    if str(device) == "cpu":
        return mb
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, dict):  # the generators' inputs
            return {k: move(x) for k, x in v.items()}
        if is_dataclass(v):
            return type(v)(**{k: move(x) for k, x in vars(v).items()})
        return v

    return MicroBatch(**{k: move(v) for k, v in mb.__dict__.items()})


def _marked(transfer):
    """DeepSpeed's blocking stage-to-stage ``send``/``recv``, marked as a wait on the peer rank
    while it blocks (``comm.p2p.waiting_for``: the heartbeat says whom this rank waits for)."""
    if getattr(transfer, "_marks_waits", False):
        return transfer

    @functools.wraps(transfer)
    def call(tensor, stage, *args, **kwargs):
        with waiting_for(ds_p2p._grid.stage_to_global(stage_id=stage)):
            return transfer(tensor, stage, *args, **kwargs)

    call._marks_waits = True
    return call


def make_engine(pm: PipelineModule, optimizer, lr_scheduler, config: dict,
                install_checkpoint_engine: Callable[[ModuleEngine], None]) -> ModuleEngine:
    """What ``deepspeed.initialize`` does for a PipelineModule, with our engine class.
    ``install_checkpoint_engine`` gives the engine the checkpointer's file format (the runtime hands
    in ``checkpoint/engine.py::install``, which reads files back without running code): the engine
    knows no checkpoint format."""
    ds_p2p.send, ds_p2p.recv = _marked(ds_p2p.send), _marked(ds_p2p.recv)
    mpu = pm.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    engine = ModuleEngine(
        args=None,
        model=pm,
        optimizer=optimizer,
        model_parameters=None,
        training_data=None,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=False,
        collate_fn=None,
        config=config,
        config_class=config_class,
    )
    install_checkpoint_engine(engine)
    return engine
