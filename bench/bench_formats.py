"""Producer throughput on real JPEGs at the paper's sizes, and producer cores per GPU for MLLM-9B.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_formats.py [--images 48] [--sequences 4]

1. Writes JPEGs (real photographs shipped with scikit-image, resized with PIL to the paper's
   512 and 1024 px configurations, quality 90) into a temporary folder and a webdataset tar.
2. Times, on one core, per image: decode + resize to an encoder input side (224 / 336 / 448 px,
   multiples of ViT-H's 14 px patch) + patchify; decode + centre crop + resize to MLLM-9B's 512 px
   generation target. Then the whole producer path (``data.source: webdataset``: plan with header
   checks, tokenise, pack 8K sequences, decode, resize) in sequences and images per second.
3. Takes MLLM-9B's step time from the planner on the paper's figures (``planner.scale``: Fig. 3
   profile, 1920 sequences of 8K tokens, LAION-400M statistics) and from the paper's own
   throughput (Fig. 15/16), and prints the arithmetic for the producer cores each GPU needs so
   that the trainer waits less than 2% of a step, for the two ways of splitting the work.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from PIL import Image  # noqa: E402

from disttrain_ds.data.config import DataConfig  # noqa: E402
from disttrain_ds.data.images import to_tensor  # noqa: E402
from disttrain_ds.data.registry import open_source  # noqa: E402
from disttrain_ds.samples import GenShape, ShapeSpec  # noqa: E402

PATCH = 14
INPUT_SIDES = (224, 336, 448)
GEN_SIDE = 512
WAIT_FRACTION = 0.02
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field")


def photo_jpegs(n: int, side: int) -> list[bytes]:
    """``n`` JPEGs of ``side`` x ``side`` px cut from real photographs (varied crops)."""
    import skimage.data

    out, rng = [], np.random.default_rng(side)
    for i in range(n):
        img = Image.fromarray(np.asarray(getattr(skimage.data, PHOTOS[i % len(PHOTOS)])())).convert("RGB")
        f = rng.uniform(0.6, 1.0)
        w, h = int(img.width * f), int(img.height * f)
        x, y = int(rng.integers(0, img.width - w + 1)), int(rng.integers(0, img.height - h + 1))
        buf = io.BytesIO()
        img.crop((x, y, x + w, y + h)).resize((side, side), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def patchify(t):
    """[3, H, W] -> [patches, 3 * 14 * 14], as the encoder's embedding reads it."""
    c, h, w = t.shape
    return t.reshape(c, h // PATCH, PATCH, w // PATCH, PATCH).permute(1, 3, 0, 2, 4).reshape(-1, c * PATCH * PATCH)


def per_image_s(jpegs: list[bytes], work) -> float:
    for i, data in enumerate(jpegs[:2]):  # warm-up: first-call set-up is not per-image work
        work(Image.open(io.BytesIO(data)).convert("RGB"), i)
    t0 = time.process_time()  # CPU time of this process: one core's work, whatever else the machine runs
    for i, data in enumerate(jpegs):
        work(Image.open(io.BytesIO(data)).convert("RGB"), i)
    return (time.process_time() - t0) / len(jpegs)


def to_input(img: Image.Image, i: int):
    side = INPUT_SIDES[i % len(INPUT_SIDES)]
    return patchify(to_tensor(img.resize((side, side), Image.Resampling.BICUBIC)))


def to_target(img: Image.Image, i: int):
    s = min(img.size)
    x, y = (img.width - s) // 2, (img.height - s) // 2
    return to_tensor(img.crop((x, y, x + s, y + s)).resize((GEN_SIDE, GEN_SIDE), Image.Resampling.BICUBIC))


def write_tar(path: Path, jpegs: list[bytes]) -> None:
    words = "a photograph of an astronaut a cat coffee cup rocket on the launch pad stained tissue deep field".split()
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w") as tf:
        for i, data in enumerate(jpegs):
            caption = " ".join(rng.choice(words, size=int(rng.integers(8, 40)))).encode()
            for ext, blob in (("jpg", data), ("txt", caption)):
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))


def source_rate(tar: Path, sequences: int, cache: str) -> tuple[float, float, float]:
    """(sequences / s, input images / s, generated images / s) of the whole producer path, one core."""
    cfg = DataConfig(source="webdataset", path=str(tar), seq_len=8192, image_sizes=list(INPUT_SIDES), max_images=32,
                     gen_images=[0, 2], gen_prob=0.1, cache_dir=cache)
    src = open_source(cfg, ShapeSpec(PATCH, (GenShape(GEN_SIDE, 3, 64),)), 1, 0)
    src.global_batch(0)  # warm-up: tokenizer, first plan
    t0 = time.process_time()
    n_in = n_gen = 0
    for step in range(1, sequences + 1):
        for s in src.global_batch(step):
            n_in += len(s.images)
            n_gen += s.gen_targets[0].shape[0]
    dt = time.process_time() - t0
    return sequences / dt, n_in / dt, n_gen / dt


def mllm9b_step() -> dict:
    """MLLM-9B's step from the planner (our plan, simulated, reordered) and from the paper's Fig. 15/16."""
    from disttrain_ds.data.paper_stats import draw_sequence_layouts
    from disttrain_ds.paper import load_paper_figures, scale
    from disttrain_ds.planner.optimize import plan

    paper = load_paper_figures()
    spec = scale.model_specs(paper)["MLLM-9B"]
    seq, batch = paper["sequence_length"], paper["megatron_baseline_layout"]["global_batch"]
    costs = scale.sample_costs(draw_sequence_layouts(batch, seq, np.random.default_rng(0)), spec, seq)
    prof = scale.build_profile(paper, spec, costs, gpus=spec.scale_gpus, global_batch=batch)
    ours = plan(prof)
    sim = scale.evaluate_plan(ours, prof, costs, iterations=1, seq_len=seq, variants=("both",), budget_s=0.2)
    fig = next(r for r in paper["overall_fig15_16"] if r["model"] == "MLLM-9B")["disttrain"]
    return {"batch": batch, "seq": seq, "images": float(costs.images.mean()), "gpus_per_node": paper["hardware"]["gpus_per_node"],
            "planner": (ours.gpus, sim.t_ms["both"] / 1e3),
            "paper": (fig["gpus"], batch * seq / (fig["Mtok_s"] * 1e6))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=48, help="JPEGs per size")
    ap.add_argument("--sequences", type=int, default=4, help="8K sequences timed through the webdataset source")
    args = ap.parse_args()
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}; figures are CPU seconds of one process (one core)\n")
    rates = {}
    print("| source JPEG | decode + resize to 224/336/448 + patchify | decode + crop + resize to 512 (target) |")
    print("|---|---|---|")
    for side in (512, 1024):
        jpegs = photo_jpegs(args.images, side)
        t_in, t_gen = per_image_s(jpegs, to_input), per_image_s(jpegs, to_target)
        rates[side] = (t_in, t_gen)
        print(f"| {side} x {side} ({np.mean([len(j) for j in jpegs]) / 1024:.0f} KiB) | "
              f"{t_in * 1e3:.1f} ms = {1 / t_in:.0f} images/s | {t_gen * 1e3:.1f} ms = {1 / t_gen:.0f} images/s |")
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "00000.tar"
        write_tar(tar, photo_jpegs(args.images, 512))
        seq_s, in_s, gen_s = source_rate(tar, args.sequences, str(Path(tmp) / "cache"))
    print(f"\nWhole producer path (webdataset tar of 512 px JPEGs, 8K sequences, byte tokenizer): "
          f"{seq_s:.2f} sequences/s = {in_s:.0f} input + {gen_s:.1f} generated images/s per core\n")

    m = mllm9b_step()
    t_in, t_gen = rates[512]
    per_seq = m["images"] * (t_in + t_gen)  # every image read and also generated, as the planner's costs assume
    print(f"MLLM-9B: global batch {m['batch']} x {m['seq']} tokens, {m['images']:.2f} images per sequence "
          f"(LAION-400M statistics); preprocessing per sequence = {m['images']:.2f} x ({t_in * 1e3:.1f} + {t_gen * 1e3:.1f}) ms "
          f"= {per_seq:.3f} core-s (512 px JPEGs; every image also a 512 px target, an upper bound)\n")
    print("| step time from | GPUs | T_step | whole batch per host (share: node) | each host its 1/hosts share (shard_parts = hosts) |")
    print("|---|---|---|---|---|")
    for name, (gpus, t_step) in (("planner (our plan, simulated, reordered)", m["planner"]), ("paper Fig. 15/16 throughput", m["paper"])):
        hosts = gpus // m["gpus_per_node"]
        # wait per step = max(0, work / cores - T_step) < 2% T_step  <=>  cores > work / (1.02 T_step)
        work = m["batch"] * per_seq
        whole = work / ((1 + WAIT_FRACTION) * t_step) / m["gpus_per_node"]
        share = work / hosts / ((1 + WAIT_FRACTION) * t_step) / m["gpus_per_node"]
        print(f"| {name} | {gpus} ({hosts} hosts) | {t_step:.2f} s | {work:.0f} core-s / ({1 + WAIT_FRACTION} x {t_step:.2f} s) / "
              f"{m['gpus_per_node']} = {whole:.1f} cores per GPU | {work:.0f} / {hosts} / ({1 + WAIT_FRACTION} x {t_step:.2f}) / "
              f"{m['gpus_per_node']} = {share:.2f} cores per GPU |")
    print("\nCores: producers running steadily ahead (queue_depth >= 2) make the trainer wait max(0, work/cores - T_step) "
          "per step; below 2% of T_step needs cores > work / (1.02 T_step). With share: node every host prepares the "
          "whole global batch; only with the batch split over hosts (data.shard_parts, each host computing its parts) "
          "does the per-GPU figure fall to the right-hand column.")


if __name__ == "__main__":
    main()
