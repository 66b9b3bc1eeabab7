"""Checkpoint files read back: plain data only (no code runs), checksums, RNG round trip."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain_ds.checkpoint.files import (
    CheckpointFileError,
    file_entry,
    file_problem,
    load_data_state,
    load_rng,
    safe_load,
    save_data_state,
    save_rng,
)
from disttrain_ds.errors import ConfigError


class OpensAFile:
    """Unpickling this creates the marker file: the payload a crafted checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class RunsAShellCommand:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


PAYLOADS = [OpensAFile, RunsAShellCommand]


def plant(path: Path, payload, marker: Path) -> None:
    """A torch file that looks like a state dict but carries ``payload``."""
    torch.save({"weight": torch.ones(3), "extra": payload(marker)}, path)


def refused(exc: pytest.ExceptionInfo, path: Path) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and "not a plain checkpoint" in msg, msg


@pytest.mark.parametrize("payload", PAYLOADS)
def test_rng_file_with_a_pickle_payload_is_refused_without_running_it(tmp_path, payload):
    marker, path = tmp_path / "marker", tmp_path / "rank00000.pt"
    plant(path, payload, marker)
    with pytest.raises(CheckpointFileError) as e:
        load_rng(path)
    refused(e, path)
    assert isinstance(e.value, ConfigError) and not marker.exists()


@pytest.mark.parametrize("payload", PAYLOADS)
def test_deepspeed_file_with_a_pickle_payload_is_refused_without_running_it(tmp_path, payload):
    from disttrain_ds.checkpoint.engine import SafeCheckpointEngine

    marker, path = tmp_path / "marker", tmp_path / "layer_00-model_00-model_states.pt"
    plant(path, payload, marker)
    with pytest.raises(CheckpointFileError) as e:
        SafeCheckpointEngine().load(str(path), map_location=lambda storage, loc: storage)
    refused(e, path)
    assert not marker.exists()


def test_data_state_holding_a_pickle_is_refused_without_running_it(tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "data.json"
    plant(path, OpensAFile, marker)
    with pytest.raises(CheckpointFileError, match="is not a plain checkpoint \\(not JSON") as e:
        load_data_state(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value) and not marker.exists()


def test_data_state_round_trips_as_json(tmp_path):
    state = {"next_step": 3, "cursor": {"epoch": 0, "pos": 17, "skips": [["too_long", 2]]}, "decode_failures": {"2": 1}}
    save_data_state(state, tmp_path / "data.json")
    assert load_data_state(tmp_path / "data.json") == state
    assert json.loads((tmp_path / "data.json").read_text()) == {"source": state}


def test_deepspeed_optimizer_types_load_but_nothing_else(tmp_path):
    """ZeRO / bf16 optimizer states hold these DeepSpeed objects; they load as data."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from disttrain_ds.checkpoint.engine import SafeCheckpointEngine

    engine = SafeCheckpointEngine()
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.optimizer_states, "loss_scaler": LossScaler(1.0),
                                      "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
                                      "single_partition_of_fp32_groups": [torch.arange(4.0)]}}
    engine.save(state, str(path))
    assert engine.take_saved() == [str(path)] and engine.take_saved() == []
    back = engine.load(str(path), map_location="cpu")["optimizer_state_dict"]
    assert back["zero_stage"] is ZeroStageEnum.optimizer_states and back["loss_scaler"].cur_scale == 1.0
    assert back["param_slice_mappings"][0]["w"].numel == 4 and torch.equal(back["single_partition_of_fp32_groups"][0], torch.arange(4.0))


def test_safe_engine_reads_only_files_the_manifest_lists_at_their_size(tmp_path):
    from disttrain_ds.checkpoint.engine import SafeCheckpointEngine

    engine = SafeCheckpointEngine()
    listed, stray = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "mp_rank_01_model_states.pt"
    torch.save({"module": {}}, listed)
    torch.save({"module": {}}, stray)
    engine.expected = {str(listed): listed.stat().st_size}
    assert engine.load(str(listed)) == {"module": {}}
    with pytest.raises(CheckpointFileError, match="not listed in the checkpoint's manifest"):
        engine.load(str(stray))
    engine.expected = {str(listed): 1}
    with pytest.raises(CheckpointFileError, match="the manifest says 1"):
        engine.load(str(listed))


def test_truncated_torch_file_is_one_line(tmp_path):
    path = tmp_path / "rank00000.pt"
    save_rng(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointFileError, match="cannot be read") as e:
        safe_load(path)
    assert "\n" not in str(e.value)


def test_flipped_byte_fails_the_checksum_and_names_the_file(tmp_path):
    path = tmp_path / "layer_01-model_00-model_states.pt"
    torch.save({"weight": torch.randn(64, 64)}, path)
    entry = file_entry(path)
    assert file_problem(tmp_path, path.name, entry) is None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert file_problem(tmp_path, path.name, entry) == f"{path.name} does not match its sha256 checksum"
    path.write_bytes(bytes(data[:-1]))
    assert "the manifest says" in file_problem(tmp_path, path.name, entry)
    path.unlink()
    assert file_problem(tmp_path, path.name, entry) == f"{path.name} is missing"


def test_rng_states_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's state
    save_rng(tmp_path / "rank00000.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_rng(tmp_path / "rank00000.pt")
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_rng_file_of_the_wrong_shape_is_one_line(tmp_path):
    torch.save({"python": torch.ones(2)}, tmp_path / "rank00000.pt")
    with pytest.raises(CheckpointFileError, match="does not hold RNG states") as e:
        load_rng(tmp_path / "rank00000.pt")
    assert "\n" not in str(e.value)


class _BuiltEngine:
    """What ``install`` looks at on a freshly built DeepSpeed engine."""

    def __init__(self, checkpoint_engine, universal: bool = False):
        self.checkpoint_engine, self._config, self.universal = checkpoint_engine, None, universal

    def load_universal_checkpoint(self) -> bool:
        return self.universal


def test_every_engine_gets_the_safe_checkpoint_engine_and_bypasses_are_refused():
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from disttrain_ds.checkpoint.engine import SafeCheckpointEngine, install

    engine = _BuiltEngine(TorchCheckpointEngine())
    assert isinstance(install(engine), SafeCheckpointEngine) and isinstance(engine.checkpoint_engine, SafeCheckpointEngine)

    class OtherWriter(TorchCheckpointEngine):
        pass

    with pytest.raises(ConfigError, match="checkpoint engine OtherWriter is not supported"):
        install(_BuiltEngine(OtherWriter()))
    with pytest.raises(ConfigError, match="'load_universal_checkpoint' is not supported"):
        install(_BuiltEngine(TorchCheckpointEngine(), universal=True))
