"""One training step (forward + backward + optimizer step) per MLLM module on one GPU, with MFU.

    python bench/gpu_modules.py [--modules llm,vit,unet512,unet1024] [--steps 10] [--warmup 3]
                                [--seq-len 8192] [--batch unet512=8] [--attention auto] [--json OUT]
    python bench/gpu_modules.py --device cpu --tiny      # smoke run of the same code, tiny sizes

Modules are built from the project's own layer lists (``disttrain_ds.models``), i.e. the code
that trains: ``llm`` a ~1.1B Llama backbone (22 layers, width 2048, 16 query / 4 KV heads of
128, SwiGLU 5632, vocab 32000) on one 8K sequence; ``vit`` the ViT-H/14 encoder preset with its
input projector on 224 px images; ``unet512`` / ``unet1024`` the SD-2.1-like generator preset
with its output projector on 64x64 / 128x128 latents (512 / 1024 px images).

Precision and optimizer: parameters, gradients and AdamW moments all in bf16 (no fp32 master
copy), ``torch.optim.AdamW(fused=True)`` on CUDA (foreach on CPU); attention through PyTorch
SDPA (flash / cuDNN kernels on H100); no activation checkpointing. The 1B model at 8K then needs
about 2 + 2 + 4 bytes per parameter (~9 GB) plus roughly 20 GB of activations (estimate): well
within 80 GB.

Step time is the median over ``--steps`` timed steps after ``--warmup`` untimed ones (CUDA
events on GPU, wall clock on CPU). FLOPs come from ``disttrain_ds.cost.flops`` (causal
attention counted as L(L+1)/2 pairs), the peak from ``disttrain_ds.cost.peak``.
Without a CUDA device (and without ``--device cpu``) it prints ``skipped: no CUDA device``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain_ds.cost.flops import llm_flops_packed, projector_flops_per_token, unet_flops, vit_flops
from disttrain_ds.cost.mfu import module_mfu, tflops_per_gpu  # noqa: E402
from disttrain_ds.cost.peak import resolve_peak  # noqa: E402
from disttrain_ds.families.llama.config import LLMConfig
from disttrain_ds.families.unet.config import GENERATOR_PRESETS, GeneratorConfig
from disttrain_ds.families.vit.config import ENCODER_PRESETS, EncoderConfig  # noqa: E402
from disttrain_ds.models.layers import Sequential  # noqa: E402

# The model modules pull in transformers / diffusers (seconds to import): each case imports its
# own when built, so a skipped run or an LLM-only run does not pay for the others.

MODULES = ("llm", "vit", "unet512", "unet1024")
LLM_1B = dict(hidden_size=2048, layers=22, heads=16, kv_heads=4, ffn_hidden=5632, vocab_size=32000, max_position=8192)
LLM_TINY = dict(hidden_size=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256, max_position=8192)
PROJ_WIDTH = {False: 4096, True: 64}  # LLM width the projectors map to/from: MLLM-9B's llama-7b
DEFAULT_BATCH = {False: dict(llm=1, vit=32, unet512=8, unet1024=2), True: dict(llm=1, vit=2, unet512=2, unet1024=1)}
LATENT = {False: dict(unet512=64, unet1024=128), True: dict(unet512=8, unet1024=16)}
MFU_GOAL = ("llm", 0.50, "H100")  # module, MFU fraction, device the goal is set for
BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


@dataclass
class Case:
    """One module to benchmark: how to build it, feed it and count its FLOPs."""

    name: str
    """Row name (llm, vit, unet512, unet1024)."""
    shape: str
    """Human description of the batch (e.g. '1 x 8192 tokens')."""
    build: Callable[[], list[torch.nn.Module]]
    """Builds the module's layers (on the current default device)."""
    inputs: Callable[[torch.device, torch.dtype], tuple]
    """(model input, loss target) on the device."""
    loss: Callable[[object, object], torch.Tensor]
    """Scalar training loss from (model output, loss target)."""
    flops: Callable[[], float]
    """Training FLOPs of one step (forward + backward)."""


@dataclass
class Result:
    """One row of the final table."""

    module: str
    """Case name."""
    shape: str
    """Batch description."""
    params: int = 0
    """Parameter count."""
    step_ms: float = float("nan")
    """Median step time in milliseconds."""
    tflops: float = float("nan")
    """Achieved TFLOP/s (FLOPs counter / step time)."""
    mfu: float = float("nan")
    """Fraction of the device peak."""
    peak_mem_gib: float = float("nan")
    """Peak allocated device memory (CUDA only)."""
    note: str = ""
    """Goal verdict, or what went wrong."""
    samples_ms: list[float] = field(default_factory=list)
    """Every timed step, milliseconds."""


def llm_case(tiny: bool, seq_len: int, batch: int, docs: int = 1, doc_attention: str = "auto") -> Case:
    from disttrain_ds.families import BuildContext
    from disttrain_ds.families.llama.model import llm_layers
    from disttrain_ds.models.objectives import lm_loss_sum
    from disttrain_ds.samples import doc_ids

    cfg = LLMConfig(preset="bench", doc_attention=doc_attention, **(LLM_TINY if tiny else LLM_1B))
    cfg.max_position = max(cfg.max_position, seq_len)
    # ``docs`` equal documents per packed sequence (the last one takes the remainder).
    lens = (seq_len // docs,) * (docs - 1) + (seq_len - (seq_len // docs) * (docs - 1),)
    image_token = cfg.vocab_size - 1  # never drawn below: the batch is text only

    def inputs(device, dtype):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size - 1, (batch, seq_len), generator=g).to(device)
        labels = torch.randint(0, cfg.vocab_size - 1, (batch, seq_len), generator=g).to(device)
        docs_ = doc_ids(lens, seq_len).expand(batch, seq_len).contiguous().to(device)
        return (ids, torch.zeros(0, cfg.hidden_size, device=device, dtype=dtype), docs_), labels

    flops = lambda: llm_flops_packed(  # noqa: E731
        layers=cfg.layers, hidden=cfg.hidden_size, ffn_hidden=cfg.ffn_hidden, heads=cfg.heads,
        kv_heads=cfg.kv_heads, vocab=cfg.vocab_size, doc_lens=list(lens) * batch)
    shape = f"{batch} x {seq_len} tokens" + (f", {docs} docs" if docs > 1 else "")
    return Case("llm", shape, lambda: [d.build() for d in llm_layers(cfg, BuildContext("llm", 0, cfg.hidden_size, image_token))],
                inputs, lambda out, labels: lm_loss_sum(out[0], labels) / labels.numel(), flops)


def vit_case(tiny: bool, batch: int) -> Case:
    from disttrain_ds.families import BuildContext
    from disttrain_ds.families.vit.model import encoder_layers
    from disttrain_ds.models.pixels import pack_images
    from disttrain_ds.models.projectors import InputProjector

    cfg = EncoderConfig() if tiny else EncoderConfig(preset="vit-h-14", **ENCODER_PRESETS["vit-h-14"])
    width, side = PROJ_WIDTH[tiny], cfg.image_size
    patches = (side // cfg.patch_size) ** 2

    def inputs(device, dtype):
        g = torch.Generator().manual_seed(0)
        flat, hw = pack_images([torch.randn(3, side, side, generator=g) for _ in range(batch)])
        return (flat.to(device, dtype), hw.to(device)), None

    def flops() -> float:
        enc = vit_flops(layers=cfg.layers, hidden=cfg.hidden_size, ffn_hidden=cfg.ffn_hidden,
                        patches_per_image=[patches] * batch, patch_size=cfg.patch_size)
        proj = projector_flops_per_token(in_dim=cfg.hidden_size, hidden_dim=width, out_dim=width)
        return enc + proj * patches * batch

    return Case("vit", f"{batch} x {side}px ({patches} patches)",
                lambda: [*(d.build() for d in encoder_layers(cfg, BuildContext("encoder", 0, width))),
                         InputProjector(cfg.hidden_size, width)],
                inputs, lambda out, _: out.float().square().mean(), flops)


def unet_case(name: str, tiny: bool, batch: int) -> Case:
    from disttrain_ds.families import BuildContext
    from disttrain_ds.families.unet.model import generator_layers, unet_kwargs
    from disttrain_ds.models.objectives import diffusion_loss
    from disttrain_ds.models.projectors import ConditionProjector

    latent = LATENT[tiny][name]
    base = GeneratorConfig() if tiny else GeneratorConfig(preset="sd21", **GENERATOR_PRESETS["sd21"])
    cfg = replace(base, resolution=latent)
    width = PROJ_WIDTH[tiny]

    def inputs(device, dtype):
        g = torch.Generator().manual_seed(0)
        c, k = cfg.in_channels, cfg.query_tokens
        states = torch.randn(batch, k, width, generator=g).to(device, dtype)
        noisy = torch.randn(batch, c, latent, latent, generator=g).to(device, dtype)
        noise = torch.randn(batch, c, latent, latent, generator=g).to(device, dtype)
        steps = torch.randint(0, cfg.train_timesteps, (batch,), generator=g).to(device)
        weights = torch.full((batch,), 1.0 / batch, device=device)
        return (states, noisy, steps), (noise, weights)

    def flops() -> float:
        net = unet_flops(unet_kwargs(cfg), batch=batch, resolution=latent, cond_tokens=cfg.query_tokens)
        proj = projector_flops_per_token(in_dim=width, hidden_dim=cfg.cross_attention_dim,
                                         out_dim=cfg.cross_attention_dim)
        return net + proj * batch * cfg.query_tokens

    return Case(name, f"{batch} x {latent}x{latent} latent",
                lambda: [ConditionProjector(width, cfg.cross_attention_dim),
                         *(d.build() for d in generator_layers(cfg, BuildContext("generator", 0, width)))],
                inputs, lambda out, tgt: diffusion_loss(out, tgt[0], tgt[1]), flops)


def build_cases(names: list[str], tiny: bool, seq_len: int, batch: dict[str, int], docs: int = 1,
                doc_attention: str = "auto") -> list[Case]:
    out = []
    for name in names:
        if name == "llm":
            out.append(llm_case(tiny, seq_len, batch[name], docs, doc_attention))
        elif name == "vit":
            out.append(vit_case(tiny, batch[name]))
        else:
            out.append(unet_case(name, tiny, batch[name]))
    return out


def _drop_build_caches() -> None:
    # The ViT and U-Net builders keep the whole initial fp32 model cached for their pipeline
    # layers to copy from; on a GPU that is gigabytes this benchmark never needs again.
    from disttrain_ds.families import clear_build_caches

    clear_build_caches()


def _attention(backend: str):
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([kinds[backend]])


def _optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    return torch.optim.AdamW(params, lr=1e-5, foreach=True)


def _timer(device: torch.device):
    """Returns ``measure(fn) -> milliseconds``: CUDA events on GPU, wall clock on CPU."""
    if device.type == "cuda":
        def measure(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def measure(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return measure


def run_case(case: Case, device: torch.device, dtype: torch.dtype, steps: int, warmup: int,
             peak: float, backend: str, compile_layers: bool) -> Result:
    res = Result(case.name, case.shape)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        layers = case.build()
    _drop_build_caches()
    if compile_layers:
        layers = [torch.compile(layer) for layer in layers]
    model = Sequential(layers).to(device=device, dtype=dtype)
    res.params = sum(p.numel() for p in model.parameters())
    opt = _optimizer(model.parameters(), device)
    x, target = case.inputs(device, dtype)

    def step() -> None:
        with _attention(backend):
            loss = case.loss(model(x), target)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measure = _timer(device)
    for _ in range(warmup):
        measure(step)
    res.samples_ms = [measure(step) for _ in range(steps)]
    res.step_ms = statistics.median(res.samples_ms)
    flops = case.flops()
    res.tflops = tflops_per_gpu(flops, 1, res.step_ms / 1e3)
    res.mfu = module_mfu(flops, 1, peak, res.step_ms / 1e3)
    if device.type == "cuda":
        res.peak_mem_gib = torch.cuda.max_memory_allocated(device) / 2**30
    return res


def goal_note(res: Result, device_name: str) -> str:
    module, target, where = MFU_GOAL
    if res.module != module or res.mfu != res.mfu:
        return ""
    if where.lower() not in device_name.lower():
        return f"goal >= {target:.0%} MFU on {where} (this is {device_name})"
    return f"goal >= {target:.0%} MFU on {where}: {'met' if res.mfu >= target else 'MISSED'}"


def table(results: list[Result]) -> str:
    lines = ["| module | batch | params | step ms | TFLOP/s | MFU | peak mem GiB | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = "-" if r.peak_mem_gib != r.peak_mem_gib else f"{r.peak_mem_gib:.1f}"
        lines.append(f"| {r.module} | {r.shape} | {r.params / 1e6:.4g}M | {r.step_ms:.1f} | {r.tflops:.3g} "
                     f"| {r.mfu:.1%} | {mem} | {r.note} |")
    return "\n".join(lines)


def parse_batch(items: list[str], tiny: bool) -> dict[str, int]:
    batch = dict(DEFAULT_BATCH[tiny])
    for item in items:
        name, _, value = item.partition("=")
        if name not in MODULES or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--batch {item!r}: expected MODULE=N with MODULE in {', '.join(MODULES)} and N >= 1")
        batch[name] = int(value)
    return batch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modules", default=",".join(MODULES), help=f"comma list of {', '.join(MODULES)}")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--seq-len", type=int, default=None, help="LLM sequence length (default 8192; 64 with --tiny)")
    ap.add_argument("--batch", action="append", default=[], metavar="MODULE=N", help="per-module batch size")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--attention", default="auto", choices=BACKENDS, help="restrict SDPA to one backend")
    ap.add_argument("--docs", type=int, default=1, help="LLM: equal documents per packed sequence (attention stays in each)")
    ap.add_argument("--doc-attention", default="auto", choices=("auto", "spans", "flex"),
                    help="LLM: document attention path (model.<llm>.doc_attention)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak instead of the table's")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.modules.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODULES))
    if unknown or not names:
        raise SystemExit(f"--modules: unknown {unknown}; choose from {', '.join(MODULES)}")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.docs < 1:
        raise SystemExit("--docs must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    device = torch.device(args.device)
    seq_len = args.seq_len or (64 if args.tiny else 8192)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        peak, peak_src = resolve_peak(args.peak_tflops, device_name)
    except ValueError as exc:
        raise SystemExit(f"{exc} (pass --peak-tflops)") from None
    print(f"device: {device_name}; peak {peak:.1f} TFLOP/s ({peak_src}); bf16 params/grads/AdamW states, "
          f"{'fused' if device.type == 'cuda' else 'foreach'} AdamW; attention: {args.attention}, documents {args.doc_attention}; "
          f"torch {torch.__version__}")
    results = []
    for case in build_cases(names, args.tiny, seq_len, parse_batch(args.batch, args.tiny), args.docs,
                                   args.doc_attention):
        try:
            res = run_case(case, device, torch.bfloat16, args.steps, args.warmup, peak, args.attention, args.compile)
            res.note = goal_note(res, device_name)
        except torch.OutOfMemoryError:
            res = Result(case.name, case.shape, note="out of memory (lower --batch)")
        results.append(res)
        print(f"{res.module:9s} {res.shape:28s} {res.step_ms:9.1f} ms {res.tflops:8.3g} TFLOP/s "
              f"MFU {res.mfu:6.1%}  {res.note}", flush=True)
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"device": device_name, "peak_tflops": peak, "peak_source": peak_src,
                                         "results": [r.__dict__ for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
