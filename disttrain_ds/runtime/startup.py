"""Process start-up, the same under torchrun and the ``deepspeed`` launcher.

The project starts the default process group itself, before DeepSpeed (which adopts a group that
is already there), so both launchers get one semantics:

- **one job store**: torchrun's agent store (prefixed per restart attempt) or, without an agent,
  the store rank 0 hosts, as ``env://`` would make it;
- **one backend**, agreed through that store before any backend starts: NCCL when every rank
  sees a GPU, gloo when none does; a mix stops every rank with one line;
- **one device per process**: ``LOCAL_RANK % device_count`` (a launcher that shows each process
  only its own GPU leaves one visible device);
- **eager NCCL**: the default group is bound to that device on every launcher, as the deepspeed
  launcher binds it, so every later group is a world-wide ``ncclCommSplit`` and every rank makes
  every group in one order (``parallel/groups.py``);
- **deadlines NCCL honours**: communicators are aborted on a timeout but the process lives on
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``), so the rank's own one-line error gets printed; every
  group's NCCL deadline is ``NCCL_GRACE`` past the project's own, so the project's deadline, which
  names the peer, fires first.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

from disttrain_ds.comm import nccl_emulation
from disttrain_ds.errors import ConfigError
from disttrain_ds.parallel.groups import device_bound, refuse_member_only_groups

NCCL_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING``: CleanUpOnly, abort the communicators and raise in the
waiting thread, leaving the process alive (1 and 3 end the process before it can say why)."""
NCCL_GRACE = 1.25
"""NCCL's deadline over the project's own (``parallel.comm_timeout_s``): ours fires first."""
_AGREE_PREFIX = "disttrain/startup/"


def nccl_timeout_s(comm_timeout_s: float) -> float:
    """The deadline every process group gets from NCCL's watchdog."""
    return comm_timeout_s * NCCL_GRACE


def refuse_unsafe_environment(cuda: bool) -> None:
    """Settings that hang this runtime on GPUs, refused in one line before anything starts."""
    if cuda and os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"):
        raise ConfigError("CUDA_LAUNCH_BLOCKING=1 deadlocks at step 1: boundary receives are posted ahead of the "
                          "sends they wait for, and a blocking launch waits for each; unset it")
    if cuda and nccl_emulation.enabled():
        raise ConfigError(f"{nccl_emulation.ENV} emulates NCCL on CPU processes (gloo); unset it on GPUs")


def device_index(local_rank: int, device_count: int) -> int:
    """This process's GPU: its local rank modulo the visible devices (one when the launcher
    hides the others, several when it shows the whole node)."""
    if device_count < 1:
        raise ConfigError("no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES?)")
    return local_rank % device_count


def job_store(rank: int, world: int, timeout: timedelta):
    """The job's rendezvous store: torchrun's agent store for this attempt, else rank 0's."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store across --max-restarts and env:// adds no per-attempt prefix: a
        # restarted job would read the dead attempt's addresses (Gloo connectFullMesh refused).
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timeout)
        return tdist.PrefixStore(f"disttrain/attempt/{restart}/", store)
    store, _, _ = next(tdist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    return store


def agree_backend(store, world: int, cuda: bool, timeout_s: float, poll_s: float = 0.2) -> str:
    """Every rank says whether it sees a GPU; all get the same answer or the same one-line error.
    O(1) store operations per rank: two counters, and one key the last rank sets."""
    store.add(f"{_AGREE_PREFIX}gpu", int(cuda))
    if store.add(f"{_AGREE_PREFIX}ranks", 1) == world:
        store.set(f"{_AGREE_PREFIX}all", "1")
    deadline = time.monotonic() + timeout_s
    while not store.check([f"{_AGREE_PREFIX}all"]):
        if time.monotonic() > deadline:
            came = store.add(f"{_AGREE_PREFIX}ranks", 0)
            raise ConfigError(f"only {came} of {world} ranks started within {timeout_s:.0f} s "
                              "(parallel.startup_timeout_s)")
        time.sleep(poll_s)
    gpus = store.add(f"{_AGREE_PREFIX}gpu", 0)
    return backend_for(gpus, world)


def backend_for(gpus: int, world: int) -> str:
    """NCCL if every rank sees a GPU, gloo if none does; a mix is refused."""
    if gpus == world:
        return "nccl"
    if gpus == 0:
        return "gloo"
    raise ConfigError(f"{gpus} of {world} ranks see a GPU and {world - gpus} do not: one job runs one backend "
                      "(check CUDA_VISIBLE_DEVICES and the drivers on every host)")


def init_processes(comm_timeout_s: float, startup_timeout_s: float) -> torch.device:
    """Start torch.distributed from the launcher's environment (torchrun or deepspeed)."""
    import deepspeed  # deferred: heavy, and only a training process needs it
    import deepspeed.ops

    # Only used for inference all-reduce; building it costs ~45 s per process on CPU.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    cuda = torch.cuda.is_available()
    refuse_unsafe_environment(cuda)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    timeout = timedelta(seconds=nccl_timeout_s(comm_timeout_s))
    store = job_store(rank, world, timedelta(seconds=startup_timeout_s))
    backend = agree_backend(store, world, cuda, startup_timeout_s)
    device = torch.device("cpu")
    extra = {}
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)
        device = torch.device("cuda", device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
        torch.cuda.set_device(device)
        if world > 1:  # one rank has no peer: nothing to split from
            extra["device_id"] = device  # eager NCCL, as under the deepspeed launcher
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tdist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **extra)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)  # adopts the group started above
    emulated = nccl_emulation.mode()
    if emulated:
        nccl_emulation.install(emulated, split_timeout_s=startup_timeout_s)  # NCCL's rules on gloo
    if device_bound() or emulated == "eager":
        refuse_member_only_groups()
    return device
