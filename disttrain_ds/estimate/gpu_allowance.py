"""What a GPU rank holds beside the tensors the memory estimate counts: the figures, written once.

``estimate/memory.py`` estimates tensors (weights, gradients, optimizer states, activations, ZeRO
buckets). A GPU rank also holds

* the CUDA context and the GEMM libraries' workspaces;
* NCCL's buffers: per communicator, one per channel and peer connection;
* the caching allocator's slack at the peak: blocks reserved but not allocated (fragmentation).

``AllowanceFigures`` are the numbers, each docstring saying where it comes from. None of them was
measured in this project: the H200 runs in ``docs/gpu_benchmarks.md`` and ``docs/vae.md`` report
``torch.cuda.max_memory_allocated``, tensors only. ``allowance`` prices one rank, ``rank_allowances``
every rank of a recipe from its rank map; ``memory_check.check_fits`` holds estimate + allowance to a
GPU's memory before launch, ``memory_check.startup_memory_problem`` to what a started rank finds free.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Mapping, NamedTuple

from disttrain_ds.comm.boundary import boundary_links
from disttrain_ds.estimate.memory import GIB, _size, backward_modules
from disttrain_ds.recipe.graph import topology_of

MIB = 2**20


@dataclass(frozen=True)
class AllowanceFigures:
    """The allowance's figures; ``from_env`` takes the NCCL ones from the environment ranks get."""

    cuda_context: float = 768 * MIB
    """Bytes of the CUDA context of one process. Assumed, not measured here, and documented by
    neither NVIDIA nor PyTorch: a bare PyTorch process was reported at 781 MB in nvidia-smi
    (pytorch/pytorch#34323, before CUDA's lazy module loading, which lowers it; the kernels a
    run loads on first use raise it again)."""
    workspaces: float = 4 * 32 * MIB
    """Bytes of GEMM workspaces. Documented default: cuBLAS recommends 32 MiB per workspace on
    Hopper (cuBLAS docs, ``cublasSetWorkspace``), the size PyTorch gives one on sm90+
    (pytorch/pytorch#120925); one per (handle, stream) that runs a GEMM. Four is assumed: cuBLAS
    and cuBLASLt on the compute stream and on the communicator's side stream. cuDNN takes its
    per-call workspace at run time and is not counted."""
    nccl_buffsize: float = 4 * MIB
    """Bytes of one NCCL buffer (one channel, one peer connection, SIMPLE protocol). Documented
    default of ``NCCL_BUFFSIZE`` (NCCL docs; ``DEFAULT_BUFFSIZE`` in NCCL's ``src/init.cc``)."""
    collective_channels: int = 16
    """Channels of one communicator running collectives; a ring keeps a send and a receive
    connection on each. Assumed, not measured here: NCCL picks the count from the topology, at
    most ``NCCL_MAX_NCHANNELS`` (its MAXCHANNELS by default, 32 or 64 by release); 16 lies between
    one NIC's 2 and that cap. ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` bound it."""
    p2p_channels: int = 2
    """Channels of one point-to-point connection. Documented default: without
    ``NCCL_NCHANNELS_PER_NET_PEER`` NCCL opens 2 per remote peer (``ncclTopoGetNchannels`` in
    ``src/graph/paths.cc``; NVLink peers may get more)."""
    fragmentation: float = 0.05
    """Reserved-but-unallocated bytes at the peak, as a fraction of the estimate. Assumed, not
    measured here: PyTorch's caching allocator rounds requests up and keeps freed blocks cached per
    stream, and documents no figure (its docs suggest
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` to lower it)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AllowanceFigures:
        """The defaults, with ``NCCL_BUFFSIZE``, ``NCCL_NCHANNELS_PER_NET_PEER`` and
        ``NCCL_MIN/MAX_NCHANNELS`` from ``env``; a value that is not a positive integer is skipped,
        as NCCL skips it (it warns and keeps its default)."""
        f = cls()
        got = {k: _positive_int(env.get(k)) for k in ("NCCL_BUFFSIZE", "NCCL_NCHANNELS_PER_NET_PEER",
                                                      "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")}
        channels = max(f.collective_channels, got["NCCL_MIN_NCHANNELS"] or 0)
        channels = min(channels, got["NCCL_MAX_NCHANNELS"] or channels)
        return replace(f, nccl_buffsize=float(got["NCCL_BUFFSIZE"] or f.nccl_buffsize),
                       p2p_channels=got["NCCL_NCHANNELS_PER_NET_PEER"] or f.p2p_channels,
                       collective_channels=channels)


def _positive_int(raw: str | None) -> int | None:
    try:
        value = int(raw) if raw is not None else 0
    except ValueError:
        return None
    return value if value > 0 else None


class NcclLinks(NamedTuple):
    """The NCCL connections of one rank."""

    collectives: int
    """Communicators it runs collectives on: its DP group, its TP group, and its replica's pipeline
    group (DeepSpeed all-reduces the gradient norm and broadcasts the loss over it)."""
    p2p: int
    """Point-to-point directions: each (peer, direction) the rank sends or receives on, DeepSpeed's
    stage-to-stage traffic and the boundary links (``comm/boundary.py``)."""


@dataclass(frozen=True)
class Allowance:
    """Bytes one rank holds beside its estimated tensors."""

    context: float
    """CUDA context and GEMM workspaces."""
    nccl: float
    """NCCL buffers."""
    fragmentation: float
    """The caching allocator's slack at the peak."""

    @property
    def total(self) -> float:
        return self.context + self.nccl + self.fragmentation

    def describe(self) -> str:
        """``allowance Y (context A, NCCL B, fragmentation C)``."""
        return (f"allowance {_size(self.total)} (context {_size(self.context)}, NCCL {_size(self.nccl)}, "
                f"fragmentation {_size(self.fragmentation)})")


def nccl_bytes(links: NcclLinks, figures: AllowanceFigures) -> float:
    """NCCL buffer bytes of a rank: a ring's send and receive connection on every channel of each
    collective communicator, one connection per point-to-point direction on each of its channels."""
    connections = 2 * figures.collective_channels * links.collectives + figures.p2p_channels * links.p2p
    return figures.nccl_buffsize * connections


def allowance(estimate: float, links: NcclLinks, figures: AllowanceFigures) -> Allowance:
    """The allowance of a rank whose tensors are estimated at ``estimate`` bytes."""
    return Allowance(figures.cuda_context + figures.workspaces, nccl_bytes(links, figures),
                     figures.fragmentation * estimate)


def rank_links(recipe) -> dict[int, NcclLinks]:
    """Every rank's NCCL connections under ``recipe``'s rank map (the reference layout: none)."""
    if recipe.layout == "reference":
        return {0: NcclLinks(0, 0)}

    topo = topology_of(recipe)
    backward = backward_modules(recipe)
    slot = recipe.parallel.llm.dp * recipe.train.micro_batch
    boundary: Counter[int] = Counter()
    for _, lo, hi in boundary_links(topo.modules, slot, backward, topo.edges, every_pair=recipe.parallel.post_balance):
        boundary.update((lo, hi))
    out = {}
    for m in topo.modules:
        both_ways = 2 if backward[m.name] else 1  # activations down, gradients back up
        for r in m.ranks:
            stage = m.coords(r)[0]
            neighbours = (stage > 0) + (stage < m.pp - 1)
            out[r] = NcclLinks((m.dp > 1) + (m.tp > 1) + (m.pp > 1), neighbours * both_ways + boundary[r])
    return out


def rank_allowances(recipe, totals: Mapping[int, float],
                    figures: AllowanceFigures | None = None) -> dict[int, Allowance]:
    """Each rank's allowance for its estimated ``totals`` (``memory.per_rank_totals``); none at
    all with ``train.gpu_allowance: false``. ``figures``: by default from this environment."""
    if not recipe.train.gpu_allowance:
        return {}
    figures = figures or AllowanceFigures.from_env(os.environ)
    links = rank_links(recipe)
    return {r: allowance(t, links[r], figures) for r, t in totals.items()}


__all__ = ["GIB", "MIB", "Allowance", "AllowanceFigures", "NcclLinks", "allowance", "nccl_bytes", "rank_allowances",
           "rank_links"]
