"""A benchmark module's layers trained through DeepSpeed's pipeline engine as the runtime sets it up.

``gpu_modules.py --engine`` times this beside the bare loop: the layers become a one-stage
``PipelineModule``, the engine's config is the runtime's (``recipe/deepspeed.py::engine_config``:
gradient accumulation over ``--accum`` microbatches, bf16 with DeepSpeed's fp32 master weights, its
gradient clipping) with the runtime's torch AdamW, and a step is ``engine.train_batch``: what a
module engine adds around the same kernels (its optimizer wrapper, gradient buffers and
accumulation, schedule bookkeeping), on one rank without boundary traffic.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import socket
from typing import Callable

import deepspeed
import deepspeed.ops
import torch
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.utils import logger as ds_logger

from disttrain_ds.recipe.deepspeed import engine_config


def _one_rank_world(device: torch.device) -> None:
    """A process group of this process alone (DeepSpeed's engine needs one)."""
    if torch.distributed.is_initialized():
        return
    # As the runtime: only inference all-reduces use it, and building it takes ~45 s on a CPU.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)


def engine_step(layers: list[torch.nn.Module], loss: Callable, batch: tuple, device: torch.device,
                dtype: torch.dtype, accum: int, lr: float = 1e-5) -> tuple[Callable[[], None], object]:
    """(one training step through the engine, the engine) for ``layers`` on ``batch`` = (input, target)."""
    _one_rank_world(device)
    ds_logger.setLevel(logging.WARNING)  # its set-up memory reports would bury the table
    pm = PipelineModule(layers=layers, num_stages=1, loss_fn=loss, partition_method="uniform")
    pm.to(device=device, dtype=dtype)
    cfg = engine_config({"zero_optimization": {"stage": 0}}, micro_batch=1, grad_accum=accum, dp=1,
                        dtype="bf16" if dtype == torch.bfloat16 else "fp32", grad_clip=1.0)
    optimizer = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lr)
    with contextlib.redirect_stdout(io.StringIO()):  # its bf16 optimizer prints memory reports regardless
        engine = PipelineEngine(args=None, model=pm, optimizer=optimizer, model_parameters=None, training_data=None,
                                lr_scheduler=None, mpu=pm.mpu(), dist_init_required=False, collate_fn=None,
                                config=cfg, config_class=DeepSpeedConfig(cfg, pm.mpu()))
    data = itertools.repeat(batch)
    return (lambda: engine.train_batch(data_iter=data)), engine
