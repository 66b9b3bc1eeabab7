"""Launched by torchrun: one module boundary (encoder dp=1 on rank 0 -> LLM dp=WORLD-1) driven the
way the runtime drives it, on NCCL with one GPU per rank, or on gloo under NCCL's rules (CPU).

    torchrun --standalone --nproc_per_node=N tests/multiproc/run_boundary.py OUT_DIR

Four microbatches with different rows per sample (one with no rows for some replicas) cross
down and their gradients (activation x 2) come back; every rank writes what it received to
OUT_DIR/boundary_rank{r}.json, and rank 0 checks the gradients it got against what it sent.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from disttrain_ds.comm import nccl_emulation  # noqa: E402
from disttrain_ds.comm.boundary import BoundaryComm, boundary_links  # noqa: E402
from disttrain_ds.comm.p2p import P2P, PeerInfo, edge_channels, new_channel_groups  # noqa: E402
from disttrain_ds.comm.routes import blocks  # noqa: E402
from disttrain_ds.topology import ModuleGrid  # noqa: E402

FEATURES = (3, 4)
ROWS = [[3, 1, 2, 5, 0, 2], [1, 1, 4, 2, 2, 2], [2, 1, 0, 0, 0, 0], [0, 2, 1, 1, 3, 1]]  # per microbatch, per sample


def main() -> int:
    out = Path(sys.argv[1])
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        if nccl_emulation.enabled():
            nccl_emulation.install()
    up, down = ModuleGrid("encoder", 0, dp=1, pp=1), ModuleGrid("llm", 1, dp=world - 1, pp=1)
    slot = 6
    if slot % down.dp:
        raise SystemExit(f"{world - 1} LLM replicas do not split a slot of {slot}")
    p2p = P2P(new_channel_groups(world, edge_channels([("encoder", "llm")])), rank, device, 60.0, PeerInfo({r: f"rank {r}" for r in range(world)}))
    comm = BoundaryComm(p2p, up, down, slot, "image_embeds", FEATURES, torch.float32)
    p2p.connect(boundary_links((up, down), slot, {"encoder": True, "llm": True}))
    got = {}
    if rank == 0:
        sent = []
        for mb, rows in enumerate(ROWS):  # forwards, each followed by its gradient receive (1F1B warm-up)
            act = torch.cat([torch.full((n, *FEATURES), float(10 * mb + i), device=device) for i, n in enumerate(rows)])
            comm.send_activation(mb, act, rows)
            comm.prefetch_grad(mb, rows)
            sent.append(act)
        for mb, rows in enumerate(ROWS):
            grad = comm.recv_grad(mb, rows)
            if not torch.equal(grad, 2 * sent[mb]):
                raise SystemExit(f"gradient of microbatch {mb} came back wrong")
            got[mb] = grad[:, 0, 0].tolist()
    else:
        block = blocks(slot, down.dp)[comm.dp]  # this LLM replica's samples of every slot
        mine = [rows[block.start : block.stop] for rows in ROWS]
        comm.prefetch_activation(0, mine[0])
        for mb in range(len(ROWS)):
            act = comm.recv_activation(mb, mine[mb])
            if mb + 1 < len(ROWS):
                comm.prefetch_activation(mb + 1, mine[mb + 1])
            got[mb] = act[:, 0, 0].tolist()
            comm.send_grad(mb, act * 2, mine[mb])
    p2p.flush_sends()
    (out / f"boundary_rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
