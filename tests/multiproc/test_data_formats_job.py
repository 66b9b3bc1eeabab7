"""A disaggregated job trains on a webdataset source (tar shards, img2dataset layout) to the reference."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from .conftest import launch, max_param_mismatch
from .test_fidelity import SGD, STEPS


def write_shards(root: Path, shards: int = 4, per_shard: int = 6) -> str:
    """Tar shards of JPEG + caption pairs, ``root/{00000..}.tar``."""
    root.mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(root / f"{s:05d}.tar", "w") as tf:
            for i in range(per_shard):
                buf = io.BytesIO()
                Image.new("RGB", (48 + 8 * i, 40), (40 * s, 30 * i, 200 - 40 * s)).save(buf, "JPEG")
                for ext, data in (("jpg", buf.getvalue()), ("txt", f"picture {i} of shard {s}".encode())):
                    info = tarfile.TarInfo(f"{s:05d}{i:04d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return str(root / f"{{00000..{shards - 1:05d}}}.tar")


@pytest.mark.slow
def test_disaggregated_job_on_webdataset_shards_matches_the_reference(tmp_path, reference_run):
    path = write_shards(tmp_path / "shards")
    cache = tmp_path / "cache"
    data = ["data.source=webdataset", f"data.path={path}", "data.shard_parts=2", f"data.cache_dir={cache}"]
    job = ["layout=disaggregated", "data.producers=1", "parallel.heartbeat_timeout_s=120"]  # slack for a loaded machine
    rows, params, _ = launch(tmp_path / "job", 4, [STEPS, *SGD, *data, *job])
    ref_losses, ref_params = reference_run([STEPS, *SGD, *data])  # in-process data in one process
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    worst, where = max_param_mismatch(params, ref_params)
    assert worst < 1e-5, f"{where} differs by {worst:.2e}"
    # Negative control: the same shards packed in one part give other batches, hence other losses.
    other, _ = reference_run([STEPS, *SGD, *data[:2], f"data.cache_dir={cache}"])
    assert other != pytest.approx(ref_losses, rel=1e-5)
    log = (tmp_path / "job" / "launch.log").read_text()
    assert "webdataset (" in log and "4 shards in 2 parts" in log
