"""DeepSpeed's torch checkpoint engine, reading every file back with ``weights_only=True``.

DeepSpeed reads model states, per-layer files and optimizer states through its engine's
``checkpoint_engine.load``, which unpickles with ``weights_only=False``: a crafted file runs code.
``SafeCheckpointEngine`` loads them as plain tensors and containers plus the few DeepSpeed types
its files actually hold (found by loading fp32, bf16 and ZeRO-1 checkpoints of every module), and
only files the checkpoint's manifest lists with the size on disk. It also records which files this
rank wrote, so each rank checksums its own files after a save.
"""

from __future__ import annotations

import contextlib
import os

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from disttrain_ds.checkpoint.files import WRITE_ERRORS, CheckpointFileError, safe_load
from disttrain_ds.errors import ConfigError, first_line

DEEPSPEED_TYPES = (ZeroStageEnum, LossScaler, fragment_address)
"""Non-tensor types in DeepSpeed 0.19 checkpoints: ZeRO/bf16 optimizer states hold the ZeRO stage,
the (static) loss scaler and the fp32 partition's fragment addresses."""


class SafeCheckpointEngine(TorchCheckpointEngine):
    """``TorchCheckpointEngine`` whose ``load`` cannot run code and reads only expected files."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.saved: list[str] = []
        """Absolute paths this engine wrote since the last ``take_saved``."""
        self.expected: dict[str, int] | None = None
        """Absolute path -> size of every file a load may read; None: no manifest given."""
        self.failure: str | None = None
        """The first write that failed since the last ``take_failure`` (no space, quota, read-only)."""

    def save(self, state_dict, path: str) -> None:
        # A failed write is recorded, not raised: DeepSpeed's save ends in a barrier the other ranks
        # wait at, so this rank must reach it too; the checkpointer then stops every rank alike.
        if self.failure is not None:
            return
        try:
            super().save(state_dict, path)
        except WRITE_ERRORS as exc:
            self.failure = f"{path}: {first_line(exc)}"
            with contextlib.suppress(OSError):
                os.remove(path)
            return
        self.saved.append(os.path.abspath(path))

    def take_failure(self) -> str | None:
        failure, self.failure = self.failure, None
        return failure

    def take_saved(self) -> list[str]:
        saved, self.saved = self.saved, []
        return saved

    def load(self, path: str, map_location=None):
        if self.expected is not None:
            size = self.expected.get(os.path.abspath(path))
            if size is None:
                raise CheckpointFileError(f"checkpoint file {path} is not listed in the checkpoint's manifest; refused to load it")
            try:
                actual = os.path.getsize(path)
            except OSError:
                raise CheckpointFileError(f"checkpoint file {path} is missing") from None
            if actual != size:
                raise CheckpointFileError(f"checkpoint file {path} is {actual} bytes, the manifest says {size}")
        return safe_load(path, map_location=map_location, allowed=DEEPSPEED_TYPES)


def install(engine) -> SafeCheckpointEngine:
    """Give a freshly built DeepSpeed engine the safe checkpoint engine (refusing setups that bypass it)."""
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ConfigError(
            f"deepspeed config: checkpoint engine {type(engine.checkpoint_engine).__name__} is not supported; "
            "remove 'checkpoint.writer' (checkpoints are written and read by the plain torch engine)"
        )
    if engine.load_universal_checkpoint():
        raise ConfigError(
            "deepspeed config: 'load_universal_checkpoint' is not supported (DeepSpeed reads universal "
            "checkpoints with pickle); resume from a step directory of this run instead"
        )
    engine.checkpoint_engine = SafeCheckpointEngine(engine._config)
    return engine.checkpoint_engine
