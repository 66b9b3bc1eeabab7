"""Producer throughput on real JPEGs at the paper's sizes, with and without the SD-2.1 VAE, and the
producer cores per GPU MLLM-9B needs.

    OMP_NUM_THREADS=1 python bench/bench_producers.py [--reps N] [--vae-device cpu|cuda] [--only-vae]

Real photographs shipped with scikit-image are JPEG-encoded at 512 x 512 (LAION's typical size and
the paper's generation side) and timed on one core: decode + resize to each input side of the
recipes (224 / 448 / 896), decode + centre square + resize of a 512 px generation target,
tokenising and packing one 8K sequence's captions, and encoding one 512 px target with a VAE of
SD 2.1's shape (random init: the time does not depend on the weights). MLLM-9B's step time, GPUs
and images per sequence come from the planner's paper-scale figures (``disttrain_ds/paper/scale.py``,
as ``bench/paper_scale.py``): every input image is also a generation target there, as in the
paper's profile. Cores per GPU are those whose throughput covers a GPU's share of a step's samples
within 98% of the step time (trainers then wait under 2% of a step with ``data.queue_depth`` >= 1).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")
SOURCE_SIDE = 512
INPUT_SIDES = (224, 448, 896)
GEN_SIDE = 512
WAIT_SHARE = 0.02


def jpegs(side: int) -> list[bytes]:
    """The photographs resized to ``side`` x ``side`` and JPEG-encoded (quality 90)."""
    import skimage.data

    out = []
    for name in PHOTOS:
        arr = np.asarray(getattr(skimage.data, name)())
        img = Image.fromarray(arr).convert("RGB").resize((side, side), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def per_item_ms(fn, items: list, reps: int) -> float:
    """Median CPU milliseconds of ``fn(item)`` over ``reps`` passes of ``items`` (one warm-up pass).
    CPU time of this single-threaded process, so other load on the host does not count."""
    for it in items:
        fn(it)
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        for it in items:
            fn(it)
        times.append((time.process_time() - t0) * 1e3 / len(items))
    return statistics.median(times)


def image_ms(reps: int) -> dict[str, float]:
    """Decode + resize (+ to tensor) of one image, per target side, as the data pipeline does it."""
    from disttrain_ds.data.images import _center_square, _file, to_tensor

    data = jpegs(SOURCE_SIDE)
    out = {}
    for side in INPUT_SIDES:
        out[f"input {side}"] = per_item_ms(
            lambda b, s=side: to_tensor(_file(io.BytesIO(b)).resize((s, s), Image.Resampling.BICUBIC)), data, reps)
    out[f"target {GEN_SIDE}"] = per_item_ms(
        lambda b: to_tensor(_center_square(_file(io.BytesIO(b))).resize((GEN_SIDE, GEN_SIDE), Image.Resampling.BICUBIC)),
        data, reps)
    return out


def text_ms(captions: int, reps: int) -> tuple[float, str]:
    """Tokenising ``captions`` LAION-like captions and packing them into one sequence's tensors."""
    from disttrain_ds.data.tokenizer import load_tokenizer

    try:
        tok, name = load_tokenizer("smollm2", ""), "smollm2"
    except (FileNotFoundError, OSError):
        tok, name = load_tokenizer("byte", ""), "byte"
    words = "a photo of the red car parked near an old stone house by the river at sunset".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=int(rng.integers(8, 30)))) for _ in range(captions)]

    def one(_):
        ids = [i for t in texts for i in tok.encode(t)]
        t = torch.tensor(ids + [0] * max(0, 8192 - len(ids)), dtype=torch.long)
        return t.roll(-1)

    return per_item_ms(one, [0], reps), name


def vae_ms(device: str, reps: int) -> dict[str, float]:
    """One 512 px target through a VAE of SD 2.1's shape: ms per image (batch 1; on cuda also batch
    16 and bf16), as ``models/vae.py::encode`` runs it."""
    from disttrain_ds.models.vae import build_vae, encode
    from disttrain_ds.models.vae_config import VaeConfig

    vae = build_vae(VaeConfig(preset="sd21"), seed=0).to(device)
    x = torch.rand(16 if device == "cuda" else 1, 3, GEN_SIDE, GEN_SIDE, device=device) * 2 - 1
    out = {}

    clock = time.perf_counter if device == "cuda" else time.process_time  # CPU: this process's CPU time

    def timed(fn, n: int) -> float:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (clock() - t0) * 1e3 / reps / n

    out["fp32 batch 1"] = timed(lambda: encode(vae, x[:1]), 1)
    if device == "cuda":
        with torch.no_grad():
            out["fp32 batch 16"] = timed(lambda: vae.quant_conv(vae.encoder(x)), 16)
            vb = vae.to(torch.bfloat16)
            xb = x.to(torch.bfloat16)
            out["bf16 batch 16"] = timed(lambda: vb.quant_conv(vb.encoder(xb)), 16)
    return out


def mllm9b() -> dict[str, float]:
    """MLLM-9B at the paper's scale: simulated step time of the planner's plan, GPUs, samples and
    images (each also generated) per sequence."""
    from disttrain_ds.data.paper_stats import draw_sequence_layouts
    from disttrain_ds.paper import load_paper_figures, scale

    paper = load_paper_figures(None)
    spec = scale.model_specs(paper)["MLLM-9B"]
    seq, batch = paper["sequence_length"], paper["megatron_baseline_layout"]["global_batch"]
    costs = scale.sample_costs(draw_sequence_layouts(batch, seq, np.random.default_rng(0)), spec, seq)
    prof = scale.build_profile(paper, spec, costs, gpus=spec.scale_gpus, global_batch=batch)
    p = scale.paper_plans(prof, spec)["ours"]
    res = scale.evaluate_plan(p, prof, costs, iterations=1, seq_len=seq, variants=("both",), budget_s=0.1)
    sides = [int(round(math.sqrt(n))) * scale.ENCODER_PATCH for s in costs.stats for n in s.image_patches]
    return {"step_s": res.t_ms["both"] / 1e3, "gpus": p.gpus, "gen_gpus": p.module("generator").gpus,
            "peak_tflops": prof.peak_tflops,
            "batch": batch, "images": float(costs.images.mean()), "gen_side": spec.resolution,
            "sides": sides}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="timed passes (median)")
    ap.add_argument("--vae-device", default="cpu", help="where the VAE row is timed (cpu | cuda)")
    ap.add_argument("--only-vae", action="store_true", help="time the VAE only (e.g. on a GPU machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one producer = one core
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread per timing; "
          f"{len(PHOTOS)} scikit-image photographs as {SOURCE_SIDE}px JPEGs\n")
    vae = vae_ms(args.vae_device, args.reps if args.vae_device == "cuda" else 1)
    print(f"VAE (SD 2.1 shape) on {args.vae_device}: " + ", ".join(f"{k} {v:.1f} ms/image" for k, v in vae.items()))
    if args.only_vae:
        return 0
    imgs = image_ms(args.reps)
    m = mllm9b()
    captions = max(1, round(m["images"]))
    txt, tok = text_ms(captions, args.reps)
    # Each input image: the nearest measured input side; each is also a 512 px target.
    nearest = [min(INPUT_SIDES, key=lambda s: abs(s - side)) for side in m["sides"]]
    in_ms = statistics.fmean(imgs[f"input {s}"] for s in nearest)
    vae_cpu = vae["fp32 batch 1"] if args.vae_device == "cpu" else float("nan")
    per_seq = {"without VAE": m["images"] * (in_ms + imgs[f"target {GEN_SIDE}"]) + txt}
    per_seq["with VAE"] = per_seq["without VAE"] + m["images"] * vae_cpu
    samples_per_gpu = m["batch"] / m["gpus"]
    print("\nper image, one core (ms):")
    print("  " + "  ".join(f"{k}: {v:.1f}" for k, v in imgs.items()) + f"  tokenise+pack one sequence "
          f"({captions} captions, {tok}): {txt:.1f}")
    print(f"\nMLLM-9B (planner, paper scale): step {m['step_s']:.2f} s on {m['gpus']} GPUs "
          f"({m['gen_gpus']} generator GPUs), global batch {m['batch']}, {samples_per_gpu:.2f} sequences per GPU, "
          f"{m['images']:.2f} images per sequence (each also generated at {m['gen_side']} px)")
    print(f"\n| producer | ms per sequence (1 core) | images/s per core | sequences/s per core | "
          f"cores per GPU for < {WAIT_SHARE:.0%} wait |")
    print("|---|---|---|---|---|")
    for name, ms in per_seq.items():
        cores = samples_per_gpu * ms / 1e3 / ((1 - WAIT_SHARE) * m["step_s"])
        print(f"| {name} | {ms:.0f} | {1e3 * m['images'] / ms:.2f} | {1e3 / ms:.3f} | {math.ceil(cores)} ({cores:.2f}) |")
    from disttrain_ds.cost.flop_count import vae_encode_flops
    from disttrain_ds.models.vae_config import VaeConfig

    per_gpu = m["batch"] * m["images"] / m["gen_gpus"]
    tflop = vae_encode_flops(VaeConfig(preset="sd21"), GEN_SIDE) / 1e12
    print(f"\nVAE on the generator's GPUs instead: each of the {m['gen_gpus']} generator GPUs encodes "
          f"{per_gpu:.0f} images per step, {tflop:.3f} TFLOP each (measured count, cost/flops.py):")
    print("| VAE efficiency on the GPU (of the planner's peak "
          f"{m['peak_tflops']:.0f} TFLOP/s) | ms per image | generator-GPU seconds per step | share of the step |")
    print("|---|---|---|---|")
    for eff in (0.2, 0.4):
        ms = tflop / (eff * m["peak_tflops"]) * 1e3
        print(f"| {eff:.0%} (assumed) | {ms:.1f} | {per_gpu * ms / 1e3:.2f} | {per_gpu * ms / 1e3 / m['step_s']:.1%} |")
    if args.vae_device == "cpu":
        print("(measure the GPU row with --vae-device cuda --only-vae on a GPU host)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
