"""Frozen-VAE encoding on one GPU: images/s and ms per image at the paper's image sizes.

    python bench/gpu_vae.py [--sizes 256,512,1024] [--batch 8] [--repeats 10] [--json OUT]
    python bench/gpu_vae.py --device cpu --tiny      # smoke run of the same code

The VAE is diffusers' ``AutoencoderKL`` in the Stable Diffusion 2.1 shape (block widths
128/256/512/512, two ResNet blocks per level, 4 latent channels, 8x downsampling), random
weights (the time does not depend on them), bf16 on CUDA. Only the encoder runs (what turns a
target image into its latent), under ``torch.no_grad``: the VAE is frozen. FLOPs per image come
from ``torch.utils.flop_counter`` on one call, so the figure is what the kernels were asked to do.

These figures are the GPU side of where the VAE should run: on the generator's ranks each image
costs the ms printed here of GPU time per step; in the CPU producers it costs producer cores
(``bench/bench_producers.py`` measures those). Times are medians of ``--repeats`` timed calls
after ``--warmup`` untimed ones (CUDA events on GPU, wall clock on CPU).
Without a CUDA device (and without ``--device cpu``) it prints ``skipped: no CUDA device``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

SD21_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
                block_out_channels=(128, 256, 512, 512), norm_num_groups=32,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
TINY_VAE = dict(SD21_VAE, block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
                down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)


def build_vae(tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import AutoencoderKL
    from diffusers.utils import logging

    logging.set_verbosity_error()  # its dtype advice is for from_pretrained; here the weights are random
    torch.manual_seed(0)
    return AutoencoderKL(**(TINY_VAE if tiny else SD21_VAE)).to(device, dtype).eval().requires_grad_(False)


def timed(fn, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def run_size(vae, side: int, batch: int, device, dtype, repeats: int, warmup: int) -> dict:
    images = torch.randn(batch, 3, side, side, device=device, dtype=dtype)
    encode = lambda: vae.encode(images).latent_dist.mean  # noqa: E731  (the posterior mean: deterministic)
    with torch.no_grad():
        with FlopCounterMode(display=False) as counter:
            latents = encode()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = statistics.median(timed(encode, device, repeats, warmup))
    per_image = ms / batch
    flops = counter.get_total_flops() / batch
    return {"side": side, "batch": batch, "latent": list(latents.shape[1:]), "ms_per_batch": ms,
            "ms_per_image": per_image, "images_per_s": 1e3 / per_image, "gflop_per_image": flops / 1e9,
            "tflops": flops / (per_image * 1e-3) / 1e12,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None, help="comma list of image sides (default 256,512,1024; 32,64 with --tiny)")
    ap.add_argument("--batch", type=int, default=8, help="images per encoder call")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny VAE and sizes (CPU smoke run)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = [int(s) for s in (args.sizes or ("32,64" if args.tiny else "256,512,1024")).split(",")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {name}; VAE encoder {'tiny' if args.tiny else 'SD-2.1 shape'}, {dtype}, batch {args.batch}; "
          f"torch {torch.__version__}")
    vae = build_vae(args.tiny, device, dtype)
    rows = [run_size(vae, s, args.batch, device, dtype, args.repeats, args.warmup) for s in sizes]
    print("| image side | latent | ms / image | images/s | GFLOP / image | TFLOP/s | peak mem GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        print(f"| {r['side']} | {'x'.join(map(str, r['latent']))} | {r['ms_per_image']:.3g} | "
              f"{r['images_per_s']:.4g} | {r['gflop_per_image']:.4g} | {r['tflops']:.3g} | {mem} |")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "dtype": str(dtype), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
