"""The GPU benchmark scripts without a GPU: a clean skip, CPU smoke runs of the same code paths,
and their pure parts (MFU goal verdict, hidden-transfer fraction, argument checks)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain_ds.models import packed_tp

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}


def _load(name: str):
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses look their module up while the file executes
        spec.loader.exec_module(mod)
    return sys.modules[key]


def _run(cmd: list[str], timeout: int = 300, hide_cuda: bool = False) -> subprocess.CompletedProcess:
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""} if hide_cuda else ENV
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def test_bench_without_cuda_prints_only_the_skip_line_and_exits_zero():
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""}
    started = {script: subprocess.Popen([sys.executable, str(BENCH / script)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
               for script in ("gpu_modules.py", "gpu_comm_overlap.py", "gpu_vae.py")}  # at once: each mostly imports
    for script, proc in started.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (script, stdout[-2000:], stderr[-4000:])
        assert stdout.splitlines() == ["skipped: no CUDA device"], script


def _module_smoke(tmp_path: Path, modules: str, *extra: str) -> dict:
    out = tmp_path / "modules.json"
    proc = _run([sys.executable, str(BENCH / "gpu_modules.py"), "--device", "cpu", "--tiny", "--modules", modules,
                 "--steps", "2", "--warmup", "1", "--json", str(out), *extra])
    assert ("| module | batch | params | step ms | TFLOP/s | MFU (causal L(L+1)/2) | MFU (full L^2) | tokens/s "
            "| peak mem GiB | note |") in proc.stdout
    assert "bf16 GEMM ceiling" in proc.stdout
    data = json.loads(out.read_text())
    engine = "--engine" in extra  # each module twice: bare, then through the engine
    assert [r["module"] for r in data["results"]] == [
        m + suffix for m in modules.split(",") for suffix in (("", " (engine)") if engine else ("",))]
    assert data["gemm_ceiling_tflops"] > 0
    for r in data["results"]:
        assert f"| {r['module']} |" in proc.stdout
        assert r["params"] > 0 and r["step_ms"] > 0 and len(r["samples_ms"]) == 2
        assert r["tflops"] > 0 and 0 < r["mfu"] < 10, r
        # Full L^2 counts more attention work than causal L(L+1)/2 where there is causal attention.
        assert r["mfu_full"] > r["mfu"] if r["module"].startswith("llm") else r["mfu_full"] == r["mfu"]
        assert (r["tokens_per_s"] > 0) == r["module"].startswith("llm")
        parts = r["breakdown_ms"]
        assert set(parts) == {"attention", "optimizer", "gemm", "other", "idle"} and min(parts.values()) >= 0
        assert parts["gemm"] > 0 and parts["optimizer"] > 0, parts
    return data


def test_module_bench_tiny_cpu_smoke_trains_llm_and_vit_bare_and_through_the_engine(tmp_path):
    data = _module_smoke(tmp_path, "llm7b,vit", "--engine")
    assert data["peak_source"] == "measured CPU matmul estimate"
    assert data["results"][0]["note"] == "goal >= 50% MFU on H100 / H200 (this is cpu)"
    assert data["results"][1]["note"] == data["results"][0]["note"]  # the goal holds for the engine's row too
    assert not data["master_fp32"] and data["accum"] == 1 and not data["compiled"] and data["engine"]
    bare, engine = data["results"][0], data["results"][1]
    assert bare["params"] == engine["params"]  # the same layers, trained two ways




@pytest.mark.slow
def test_module_bench_tiny_cpu_smoke_runs_every_module(tmp_path):
    _module_smoke(tmp_path, "llm,llm13b,vit448,vitmix,vitmix_groups,unet512,unet1024")


def test_the_mixed_size_vit_rows_cycle_three_sides_and_one_runs_the_library_layer_per_size():
    mods = _load("gpu_modules")
    mix, groups = mods.build_cases(["vitmix", "vitmix_groups"], False, 8192, {"vitmix": 6, "vitmix_groups": 6})
    assert mix.shape == groups.shape == "6 images of 224/336/448px (3712 patches)"  # ViT-H/14: 256 + 576 + 1024, twice
    rows = type("Rows", (), {"is_cuda": True})()  # what the choice reads of a CUDA tensor
    assert packed_tp.varlen_items(rows, [256, 576])  # one variable-length batch on CUDA...
    with groups.context():
        assert not packed_tp.varlen_items(rows, [256, 576])  # ...or per size, for the comparison row
    with mix.context():
        assert packed_tp.varlen_items(rows, [256, 576])
    assert packed_tp.varlen_items(rows, [256, 576])  # restored


def _check_comm_json(data: dict, world: int) -> None:
    a, b = data["a"], data["b"]
    assert data["world"] == world
    assert a["gemms"] >= 1 and a["t_comm"] > 0 and a["t_compute"] > 0 and a["t_both"] > 0
    assert math.isclose(a["hidden"], (a["t_comm"] + a["t_compute"] - a["t_both"]) / a["t_comm"])
    assert [r["chunks"] for r in b["rows"]] == [1, 2, 4, 8]
    assert b["rows"][0]["speedup"] == 1.0
    # Same bf16 values, GEMMs over fewer rows: equal up to bf16 rounding of outputs near 0.2.
    assert all(r["max_diff"] < 1e-2 for r in b["rows"]), b["rows"]


def test_comm_bench_tiny_cpu_smoke_prints_both_tables(tmp_path):
    out = tmp_path / "comm.json"
    proc = _run([sys.executable, str(BENCH / "gpu_comm_overlap.py"), "--device", "cpu", "--tiny",
                 "--repeats", "2", "--json", str(out)])
    assert "| transfers ms | compute ms | both ms | hidden | goal |" in proc.stdout
    assert "| chunks | ms | speedup vs 1 | max abs diff vs chunks=1 |" in proc.stdout
    data = json.loads(out.read_text())
    _check_comm_json(data, 1)
    assert data["b"]["path"].startswith("emulated: 2 shards")


@pytest.mark.slow
def test_comm_bench_under_torchrun_uses_the_p2p_communicator_and_a_real_all_gather(tmp_path):
    out = tmp_path / "comm.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
          str(BENCH / "gpu_comm_overlap.py"), "--device", "cpu", "--tiny", "--repeats", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    _check_comm_json(data, 2)
    assert data["a"]["path"] == "P2P isend/irecv, 2 ranks (gloo)"
    assert data["b"]["path"] == "gloo all-gather, 2 ranks"


def test_hidden_fraction_is_the_share_of_transfer_time_under_compute():
    comm = _load("gpu_comm_overlap")
    assert comm.hidden_fraction(10.0, 12.0, 12.0) == 1.0  # fully hidden
    assert comm.hidden_fraction(10.0, 12.0, 22.0) == 0.0  # serialised
    assert comm.hidden_fraction(10.0, 12.0, 17.0) == 0.5
    with pytest.raises(ValueError, match="t_comm must be positive"):
        comm.hidden_fraction(0.0, 1.0, 1.0)


def test_comm_bench_refuses_more_chunks_than_shard_rows():
    comm = _load("gpu_comm_overlap")
    with pytest.raises(SystemExit, match="--chunks/--rows: chunks=32 exceeds the 16 blocks"):
        comm.main(["--device", "cpu", "--tiny", "--chunks", "1,32"])


def test_goal_verdicts_name_the_device_and_the_outcome():
    mods = _load("gpu_modules")
    row = mods.Result("llm7b", "1 x 8192 tokens", mfu=0.55)
    assert mods.goal_note(row, "NVIDIA H100 80GB HBM3") == "goal >= 50% MFU: met"
    assert mods.goal_note(mods.Result("llm7b", "", mfu=0.41), "NVIDIA H200").endswith("MISSED")
    assert mods.goal_note(row, "NVIDIA A100-SXM4-80GB") == "goal >= 50% MFU on H100 / H200 (this is NVIDIA A100-SXM4-80GB)"
    assert mods.goal_note(mods.Result("vit", "", mfu=0.39), "NVIDIA H200") == "goal >= 40% MFU: MISSED"
    assert mods.goal_note(mods.Result("unet512", "", mfu=0.31), "NVIDIA H200") == "goal >= 30% MFU: met"
    assert mods.goal_note(mods.Result("llm", "", mfu=0.9), "NVIDIA H100 80GB HBM3") == ""  # no goal for the 1B row


def test_module_bench_refuses_unknown_modules_and_bad_batches():
    mods = _load("gpu_modules")
    with pytest.raises(SystemExit, match=r"--modules: unknown \['gpt'\]"):
        mods.main(["--modules", "llm,gpt", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--batch 'vit=0': expected MODULE=N"):
        mods.parse_batch(["vit=0"], tiny=True)
    assert mods.parse_batch(["unet1024=4"], tiny=False)["unet1024"] == 4


def test_vae_bench_tiny_cpu_smoke_counts_flops_per_image_and_latent_sides(tmp_path):
    out = tmp_path / "vae.json"
    proc = _run([sys.executable, str(BENCH / "gpu_vae.py"), "--device", "cpu", "--tiny", "--sizes", "32",
                 "--batch", "2", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["latent"] == [4, 16, 16]  # the tiny VAE has two levels: one 2x downsampling
    assert row["gflop_per_image"] > 0 and row["ms_per_image"] > 0
    assert row["images_per_s"] == pytest.approx(1e3 / row["ms_per_image"])
    assert "| 32 | 4x16x16 |" in proc.stdout


def test_an_amortised_fp32_master_run_and_the_session_table_that_reads_it(tmp_path):
    data = _module_smoke(tmp_path, "llm7b", "--accum", "3", "--master-fp32", "--docs", "2")
    assert data["master_fp32"] and data["accum"] == 3
    assert data["results"][0]["shape"].endswith("2 docs")
    (tmp_path / "modules.json").rename(tmp_path / "modules_compiled.json")
    (tmp_path / "steps.jsonl").write_text('{"step": "gpu tests", "rc": 124, "seconds": 200}\n')
    text = _load("gpu_session_table").session_table(tmp_path)
    assert text.startswith("card: cpu, peak ")
    assert "| compiled, accum 3 | llm7b | 8 layers x 64" in text
    assert "modules_eager.json: missing (the step did not finish)" in text
    assert text.endswith("gpu tests: exit 124, 200 s")
    # The session script parses and every script it runs exists.
    script = (BENCH / "gpu_session.sh").read_text()
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_session.sh")]).returncode == 0
    for name in ("bench/gpu_modules.py", "bench/gpu_session_table.py", "tests/gpu"):
        assert name in script and (REPO / name).exists()


def test_profiled_kernels_fall_into_the_breakdown_categories():
    cat = _load("gpu_measure").category
    for name, want in [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "gemm"), ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA", "gemm"),
                       ("cudnn::conv2d_grouped_direct_kernel", "gemm"), ("aten::mm", "gemm"), ("aten::addmm", "gemm"),
                       ("flash_fwd_kernel", "attention"), ("cudnn_generated_fort_native_sdpa_sm90", "attention"),
                       ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
                       ("multi_tensor_apply_kernel", "optimizer"), ("aten::_fused_adamw_", "optimizer"),
                       ("vectorized_elementwise_kernel", "other"), ("aten::add_", "other"), ("aten::mm_backward", "other")]:
        assert cat(name) == want, name


def test_several_document_attention_paths_give_one_llm_row_each_side_by_side():
    mods = _load("gpu_modules")
    cases = mods.build_cases(["llm7b", "vit"], True, 64, {"llm7b": 1, "vit": 2}, docs=2, doc_attention="flex,varlen")
    assert [c.name for c in cases] == ["llm7b [flex]", "llm7b [varlen]", "vit"]
    assert [c.name for c in mods.build_cases(["llm7b"], True, 64, {"llm7b": 1}, docs=2)] == ["llm7b"]
    with pytest.raises(SystemExit, match=r"--doc-attention: unknown \['mask'\]"):
        mods.main(["--device", "cpu", "--tiny", "--modules", "llm7b", "--doc-attention", "flex,mask"])
