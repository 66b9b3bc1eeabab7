"""Launched by torchrun from the multi-process tests: train the tiny recipe in a pipeline layout,
export every rank's final parameters and what crossed the communicator.

    torchrun --standalone --nproc_per_node=N tests/multiproc/run_layout.py OUT_DIR [--fault NAME] [--recipe R]
        [key=value ...]

``--fault drop_encoder_grad`` zeroes the gradient the LLM returns to the encoder: the negative
control that the fidelity check must catch (``drop_ear_grad``: to the module named ``ear``).
``--fault swap_audio_rows`` reverses the audio rows the LLM receives, so they fill the wrong
audio placeholders. ``--fault drop_grad_from_<name>`` zeroes the gradient generator ``<name>`` returns to the LLM, and
``--fault flip_rows_to_<name>`` reverses the rows of LLM states ``<name>`` receives, so each of its
targets is conditioned on another target's queries: the negative controls for several generators.
``--fault one_channel`` sends activations and gradients
over one process group, as before the channel split: the negative control for NCCL's one stream per
pair (a gradient receive posted ahead then holds up the next activation send).
``--fault perturb_recompute`` makes activation checkpointing's backward rerun of a block differ
from its forward: the negative control for the checkpointing fidelity test. Every rank writes how
many checkpointed blocks ran and how often their layers ran (``recompute_rank<r>.json``).
``--fault post_balance_unplaced`` keeps rows a replica receives from several post-balanced replicas in
arrival order instead of its samples' order: the negative control of per-module post-balancing.
``--fault eval_zero_encoder`` zeroes what the encoder sends while evaluating (training untouched):
the negative control of the evaluation check.
``--fault skip_tied_reduce`` leaves out the sum of a tied weight's gradients over the stages holding
its copies (the embedding's and the LM head's): the negative control for tied embeddings across stages.
``--fault drop_adam_moments`` zeroes the optimizer's per-element state (Adam's moments) read back
when a checkpoint is re-sharded for another layout: the negative control for resuming under a new layout.
``--fault wrong_host_units`` makes every host read the next units of each batch instead of its own
(``data.read: host``): the negative control that a host missing its ranks' samples is caught.
Every rank writes the sample ids it read per step (``reads_rank<r>.json``) and, with
``data.reorder`` on per-host reading, the ids at every position of each batch it reordered
(``ordered_rank<r>.json``, null where another host's sample sits), and how many sequence-parallel
all-to-alls it ran (``a2a_rank<r>.json``).
``--fault member_only_groups`` makes each module's process groups with its members only
(``use_local_synchronization``), as the runtime once did, and lifts the refusal of such groups: the
negative control that an eager (device-bound) start-up stops, naming the ranks;
``--fault member_only_groups_guarded`` keeps the refusal, which stops it in one line first.
``--fault abort_lanes_rank<N>`` aborts rank N's emulated NCCL lanes after step 1, as NCCL's watchdog
aborts a communicator: the rank must say so in one line and the others must not be blamed.
``--fault stall_rank2`` stops rank 2's main thread after step 1 (its heartbeat goes on): its
neighbours' deadlines must blame it, not themselves.
``--fault drop_fp32_masters`` drops the fp32 master weights read back that way, so a bf16 engine's
masters restart from its bf16 weights: the negative control for resuming bf16 under a new layout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from deepspeed.runtime.pipe import schedule as ds_schedule  # noqa: E402

from disttrain_ds.comm.boundary import BoundaryComm  # noqa: E402
from disttrain_ds.comm.p2p import P2P  # noqa: E402
from disttrain_ds.recipe.schema import load_recipe  # noqa: E402
from disttrain_ds.runtime import distributed  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    fault = None
    if args and args[0] == "--fault":
        fault, args = args[1], args[2:]
    name = "tiny_cpu"
    if args and args[0] == "--recipe":
        name, args = args[1], args[2:]
    recipe = load_recipe(name, [f"logging.dir={out / 'run'}", *args])
    if fault in ("drop_encoder_grad", "drop_ear_grad"):
        original = BoundaryComm.send_grad
        victim = fault.split("_")[1]

        def send_zero_to_encoder(self, mb, grad, rows_per_sample):
            return original(self, mb, torch.zeros_like(grad) if self.up.name == victim else grad, rows_per_sample)

        BoundaryComm.send_grad = send_zero_to_encoder
    elif fault and fault.startswith("drop_grad_from_"):
        original = BoundaryComm.send_grad
        victim = fault.removeprefix("drop_grad_from_")

        def send_zero_from_generator(self, mb, grad, rows_per_sample):
            return original(self, mb, torch.zeros_like(grad) if self.down.name == victim else grad, rows_per_sample)

        BoundaryComm.send_grad = send_zero_from_generator
    elif fault and fault.startswith("flip_rows_to_"):
        original_recv = BoundaryComm.recv_activation
        victim = fault.removeprefix("flip_rows_to_")

        def recv_flipped(self, mb, rows_per_sample):
            out = original_recv(self, mb, rows_per_sample)
            return out.flip(0) if self.down.name == victim else out

        BoundaryComm.recv_activation = recv_flipped
    elif fault == "post_balance_unplaced":
        # Rows from several replicas kept in arrival order: samples' rows land on other samples.
        BoundaryComm._in_local_order = lambda self, out, mb, rows_per_sample: out
    elif fault == "swap_audio_rows":
        original_recv = BoundaryComm.recv_activation

        def recv_reversed(self, mb, rows_per_sample):
            out = original_recv(self, mb, rows_per_sample)
            return out.flip(0) if self.rows_key == "audio_embeds" else out

        BoundaryComm.recv_activation = recv_reversed
    elif fault == "one_channel":
        from disttrain_ds.comm.p2p import ACT, GRAD
        from disttrain_ds.parallel.groups import ProcessGroups

        original_get = ProcessGroups.get

        def one_group(self, key):  # each edge's gradient channel is its activation channel's group
            if key[0] == "channel" and key[1].startswith(GRAD):
                key = ("channel", ACT + key[1].removeprefix(GRAD))
            return original_get(self, key)

        ProcessGroups.get = one_group
    elif fault == "eval_zero_encoder":
        from disttrain_ds.parallel.engine import ModuleEngine

        original_eval, original_send = ModuleEngine.run_eval, BoundaryComm.send_activation
        evaluating = []

        def flagged_eval(self, batches):
            evaluating.append(True)
            try:
                return original_eval(self, batches)
            finally:
                evaluating.pop()

        def send_zero_while_evaluating(self, mb, tensor, rows_per_sample):
            zero = evaluating and self.up.name == "encoder"
            return original_send(self, mb, torch.zeros_like(tensor) if zero else tensor, rows_per_sample)

        ModuleEngine.run_eval, BoundaryComm.send_activation = flagged_eval, send_zero_while_evaluating
    elif fault == "skip_tied_reduce":
        from disttrain_ds.parallel.engine import ModuleEngine

        ModuleEngine._exec_reduce_tied = lambda self: None  # each copy of a tied weight steps on its own share
        ModuleEngine._DISAGG_MAP = {**ModuleEngine._DISAGG_MAP, ds_schedule.ReduceTiedGrads: lambda self: None}
    elif fault == "drop_adam_moments":
        from disttrain_ds.checkpoint import reshard_shards

        read = reshard_shards.read_module

        def read_without_moments(*a, **kw):
            full = read(*a, **kw)
            for st in full.values():
                st.optim = {k: torch.zeros_like(v) for k, v in st.optim.items()}
            return full

        reshard_shards.read_module = read_without_moments
    elif fault == "drop_fp32_masters":
        from disttrain_ds.checkpoint import reshard_shards

        read_all = reshard_shards.read_module

        def read_without_masters(*a, **kw):
            full = read_all(*a, **kw)
            for st in full.values():
                st.master = None  # the loader then takes the (bf16) weight as the master
            return full

        reshard_shards.read_module = read_without_masters
    elif fault == "wrong_host_units":
        from disttrain_ds.data.producers import ProducedSource

        original_read_only = ProducedSource.read_only

        def read_next_units(self, units):
            n = len(self.inner.units())
            return original_read_only(self, tuple(sorted((u + 1) % n for u in units)))

        ProducedSource.read_only = read_next_units
    elif fault in ("member_only_groups", "member_only_groups_guarded"):
        import torch.distributed as dist

        from disttrain_ds.parallel.groups import ProcessGroups
        from disttrain_ds.runtime import startup

        if fault == "member_only_groups":
            startup.refuse_member_only_groups = lambda: None  # show what the emulation itself catches

        def make_member_only(self, specs, timeout_s, new_group=None):
            """The old start-up: every module's groups made by their members only."""
            from datetime import timedelta

            for spec in specs:
                whole = len(spec.ranks) == dist.get_world_size()
                if whole or self.rank in spec.ranks:
                    handle = dist.new_group(list(spec.ranks), timeout=timedelta(seconds=timeout_s),
                                            backend=spec.backend, use_local_synchronization=not whole)
                    if self.rank in spec.ranks:
                        self.handles[spec.key], self.ranks[spec.key] = handle, spec.ranks
            return self

        ProcessGroups.make = make_member_only
    elif fault and fault.startswith("abort_lanes_rank"):
        from disttrain_ds.comm import nccl_emulation
        from disttrain_ds.runtime.callbacks import preemption

        victim = int(fault.removeprefix("abort_lanes_rank"))
        original_kill = preemption.injected_kill

        def abort_after_step_1(rank, step):
            # As NCCL's watchdog aborts a communicator: this rank's transfers fail from now on.
            if rank == victim and step == 1:
                nccl_emulation.abort_lanes(f"communicator aborted on rank {rank}")
            return original_kill(rank, step)

        preemption.injected_kill = abort_after_step_1
    elif fault == "stall_rank2":
        import time

        from disttrain_ds.runtime.callbacks import preemption

        original_kill = preemption.injected_kill

        def stall_after_step_1(rank, step):
            if rank == 2 and step == 1:
                time.sleep(600)  # alive and beating, but its transfers never come
            return original_kill(rank, step)

        preemption.injected_kill = stall_after_step_1
    elif fault == "disk_full_rank2_step2":
        import errno

        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        original_save = TorchCheckpointEngine.save

        def no_space_for_step_2(self, state_dict, path):
            # As a file system that fills while rank 2 writes its share of step 2's checkpoint.
            if os.environ.get("RANK") == "2" and "step_00000002" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return original_save(self, state_dict, path)

        TorchCheckpointEngine.save = no_space_for_step_2
    elif fault is not None and fault != "perturb_recompute":
        raise SystemExit(f"unknown fault {fault!r}")
    from disttrain_ds.parallel import pipeline_module

    recomputed = {"blocks": 0, "runs": 0}  # checkpointed blocks, and how often their layers ran
    original_recompute = pipeline_module.recompute

    def counting_recompute(function, *a):
        recomputed["blocks"] += 1
        runs = [0]  # of this block, for this microbatch

        def counted(*x):
            recomputed["runs"] += 1
            runs[0] += 1
            if fault == "perturb_recompute" and runs[0] == 2:
                # The backward's rerun sees other inputs than the forward did (negative control):
                # the activations it saves for the gradients differ.
                x = tuple(t * 1.001 if torch.is_tensor(t) and t.is_floating_point() else t for t in x)
            return function(*x)

        return original_recompute(counted, *a)

    pipeline_module.recompute = counting_recompute
    seen: list[BoundaryComm] = []
    original_init = BoundaryComm.__init__

    def tracking_init(self, *a, **kw):
        original_init(self, *a, **kw)
        seen.append(self)

    BoundaryComm.__init__ = tracking_init
    sends: list[list[int]] = []  # [destination rank, elements] of every inter-engine send
    original_isend = P2P.isend

    def counting_isend(self, tensor, dst, channel, what):
        sends.append([dst, tensor.numel()])
        return original_isend(self, tensor, dst, channel, what)

    P2P.isend = counting_isend
    from disttrain_ds.data import producers

    reads: list[list[int]] = []  # [step, sample id] of every sample this process read (in-process data)
    original_prepare = producers.prepare

    def recording_prepare(source, step, *a, **kw):
        samples = original_prepare(source, step, *a, **kw)
        reads.extend([step, s.sample_id] for s in samples if s is not None)
        return samples

    producers.prepare = recording_prepare
    from disttrain_ds.reorder import host_order

    ordered: list[list] = []  # sample id (None: another host's) at every position of each reordered batch
    original_call = host_order.HostOrder.__call__

    def recording_call(self, samples):
        got = original_call(self, samples)
        ordered.append([s.sample_id if s is not None else None for s in got])
        return got

    host_order.HostOrder.__call__ = recording_call
    from disttrain_ds.parallel import sequence_parallel

    exchanges = [0]  # sequence-parallel all-to-alls this process ran (forward and backward)
    original_exchange = sequence_parallel._exchange

    def counting_exchange(x, group):
        exchanges[0] += 1
        return original_exchange(x, group)

    sequence_parallel._exchange = counting_exchange
    rc = distributed.train_distributed(recipe, log=print, export_dir=str(out))
    rank = int(os.environ["RANK"])
    (out / f"sends_rank{rank}.json").write_text(json.dumps(sends))
    shapes = sorted({s for c in seen if c.side == "down" for s in c.shapes_seen})
    (out / f"shapes_rank{rank}.json").write_text(json.dumps(shapes))
    (out / f"recompute_rank{rank}.json").write_text(json.dumps(recomputed))
    (out / f"reads_rank{rank}.json").write_text(json.dumps(reads))
    (out / f"ordered_rank{rank}.json").write_text(json.dumps(ordered))
    (out / f"a2a_rank{rank}.json").write_text(json.dumps(exchanges[0]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
