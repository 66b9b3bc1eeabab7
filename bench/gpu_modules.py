"""One training step per MLLM module on one GPU, with MFU in both FLOP conventions.

    python bench/gpu_modules.py [--modules llm7b,vit,unet512] [--steps 10] [--warmup 3] [--accum 1]
                                [--master-fp32] [--compile] [--engine] [--seq-len 8192] [--docs 1]
                                [--batch unet512=8] [--attention auto] [--json OUT]
    python bench/gpu_modules.py --device cpu --tiny      # smoke run of the same code, tiny sizes

Modules are built from the project's own layer lists (``disttrain_ds.models``), i.e. the code
that trains: ``llm`` a ~1.1B Llama backbone (22 layers, width 2048, 16 query / 4 KV heads of 128,
SwiGLU 5632, vocab 32000); ``llm7b`` / ``llm13b`` stacks of ``--llm-layers`` decoder layers of
Llama-7B / -13B (width 4096 / 5120; the paper's MLLM-9B and -15B backbones; a stack is one
pipeline stage's share, with the embedding and the LM head) on ``--seq-len`` tokens packed from
``--docs`` documents (``--doc-attention flex,varlen``: one row per document attention path, side
by side); ``vit`` / ``vit448`` the ViT-H/14 encoder preset with its input projector
on 224 / 448 px images; ``vitmix`` the same on images of 224, 336 and 448 px in turn, their items of
three lengths in one variable-length batch (on CUDA: GEMMs over all rows, one varlen flash attention call),
and ``vitmix_groups`` the same images through the library's layer per image size (what runs off
CUDA), side by side; ``unet512`` / ``unet1024`` the SD-2.1-like generator preset with its
output projector on 64x64 / 128x128 latents (512 / 1024 px images).

Precision and optimizer: bf16 weights and compute; by default bf16 gradients and AdamW moments
stepping every microbatch; ``--master-fp32`` keeps fp32 master weights and moments as training
does (DeepSpeed's bf16 optimizer), ``--accum N`` runs N microbatches per optimizer step (MLLM-9B's
LLM steps once per 120), so the optimizer is amortised as in training; fused AdamW on CUDA.
``--compile`` compiles each layer in place as ``train.compile`` does (``models/compiled.py``).
``--engine`` also trains each module through DeepSpeed's pipeline engine as the runtime configures
it (``gpu_engine.py``: fp32 master weights, accumulation over ``--accum``, ``train_batch``), a
second row per module beside the bare loop.
Attention through the layers' own paths (PyTorch SDPA, flex for packed documents on CUDA).

Step time is the median over ``--steps`` timed steps after ``--warmup`` untimed ones (CUDA events
on GPU, wall clock on CPU); a step is ``--accum`` microbatches and one optimizer step. FLOPs come
from ``disttrain_ds.cost.flops``: MFU counts causal attention as L(L+1)/2 pairs (the project's
convention), MFU full as L^2 (torchtitan's and MosaicML's); tokens/s for the LLMs. Printed
beside them: the card, its SM clock and power limit (nvidia-smi), and the TFLOP/s of a large
bf16 GEMM measured in the same run: the ceiling a module's GEMMs could reach on this card.
Without a CUDA device (and without ``--device cpu``) it prints ``skipped: no CUDA device``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_measure import Optimizer, breakdown, card_info, gemm_ceiling, timer  # noqa: E402

from disttrain_ds.cost.flop_count import unet_flops
from disttrain_ds.cost.flops import llm_flops_packed, projector_flops_per_token, vit_flops
from disttrain_ds.cost.mfu import module_mfu, tflops_per_gpu  # noqa: E402
from disttrain_ds.cost.peak import resolve_peak  # noqa: E402
from disttrain_ds.families.llama.config import LLM_PRESETS, LLMConfig
from disttrain_ds.families.unet.config import GENERATOR_PRESETS, GeneratorConfig
from disttrain_ds.families.vit.config import ENCODER_PRESETS, EncoderConfig  # noqa: E402
from disttrain_ds.models.compiled import compile_layers  # noqa: E402
from disttrain_ds.models.layers import Sequential  # noqa: E402

# The model modules pull in transformers / diffusers (seconds to import): each case imports its
# own when built, so a skipped run or an LLM-only run does not pay for the others.

MODULES = ("llm", "llm7b", "llm13b", "vit", "vit448", "vitmix", "vitmix_groups", "unet512", "unet1024")
LLM_1B = dict(hidden_size=2048, layers=22, heads=16, kv_heads=4, ffn_hidden=5632, vocab_size=32000, max_position=8192)
LLM_SIZES = {"llm": LLM_1B, "llm7b": dict(LLM_PRESETS["llama-7b"], max_position=8192),
             "llm13b": dict(LLM_PRESETS["llama-13b"], max_position=8192)}
LLM_TINY = dict(hidden_size=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256, max_position=8192)
PROJ_WIDTH = {False: 4096, True: 64}  # LLM width the projectors map to/from: MLLM-9B's llama-7b
DEFAULT_BATCH = {False: dict(llm=1, llm7b=1, llm13b=1, vit=32, vit448=8, vitmix=12, vitmix_groups=12, unet512=8,
                             unet1024=2),
                 True: dict(llm=1, llm7b=1, llm13b=1, vit=2, vit448=1, vitmix=3, vitmix_groups=3, unet512=2,
                            unet1024=1)}
LATENT = {False: dict(unet512=64, unet1024=128), True: dict(unet512=8, unet1024=16)}
MFU_GOALS = {"llm7b": 0.50, "vit": 0.40, "unet512": 0.30}
"""MFU (causal convention) each module should reach on the cards of ``GOAL_CARDS``."""
GOAL_CARDS = ("H100", "H200")
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
    """Training FLOPs of one microbatch (forward + backward), causal attention as L(L+1)/2 pairs."""
    flops_full: Callable[[], float] | None = None
    """The same with causal attention counted as L^2 pairs; None: no causal attention (the same)."""
    tokens: int = 0
    """Tokens one microbatch trains on (LLMs; 0 elsewhere)."""
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Entered around every step (a path the case compares against)."""


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
    """Fraction of the device peak, causal attention as L(L+1)/2 pairs."""
    mfu_full: float = float("nan")
    """The same with causal attention counted as L^2 pairs (torchtitan, MosaicML)."""
    tokens_per_s: float = float("nan")
    """Tokens trained per second (LLMs)."""
    breakdown_ms: dict = field(default_factory=dict)
    """One profiled step's time by category (``breakdown``): GEMM and convolution, attention,
    optimizer, other kernels (elementwise, norms, copies), idle (the device waiting for the host)."""
    peak_mem_gib: float = float("nan")
    """Peak allocated device memory (CUDA only)."""
    note: str = ""
    """Goal verdict, or what went wrong."""
    samples_ms: list[float] = field(default_factory=list)
    """Every timed step, milliseconds."""


def llm_case(name: str, tiny: bool, seq_len: int, batch: int, docs: int = 1, doc_attention: str = "auto",
             layers: int | None = None) -> Case:
    from disttrain_ds.families import BuildContext
    from disttrain_ds.families.llama.model import llm_layers
    from disttrain_ds.models.objectives import lm_loss_sum
    from disttrain_ds.samples import doc_ids

    size = dict(LLM_TINY if tiny else LLM_SIZES[name])
    if layers is not None and name != "llm":  # a stack: one pipeline stage's share of the model
        size["layers"] = layers
    cfg = LLMConfig(preset="bench", doc_attention=doc_attention, **size)
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

    def flops(causal: bool = True) -> float:
        return llm_flops_packed(layers=cfg.layers, hidden=cfg.hidden_size, ffn_hidden=cfg.ffn_hidden, heads=cfg.heads,
                                kv_heads=cfg.kv_heads, vocab=cfg.vocab_size, doc_lens=list(lens) * batch, causal=causal)

    shape = f"{cfg.layers} layers x {cfg.hidden_size}, {batch} x {seq_len} tokens" + (f", {docs} docs" if docs > 1 else "")
    return Case(name, shape, lambda: [d.build() for d in llm_layers(cfg, BuildContext("llm", 0, cfg.hidden_size, image_token))],
                inputs, lambda out, labels: lm_loss_sum(out[0], labels) / labels.numel(), flops,
                lambda: flops(causal=False), batch * seq_len)


def _per_size():
    """Items of mixed lengths through the library's layer per length (``on_items`` off CUDA)."""
    from disttrain_ds.models import packed_tp

    saved = packed_tp.varlen_items
    packed_tp.varlen_items = lambda hidden, sizes: False
    try:
        yield
    finally:
        packed_tp.varlen_items = saved


def vit_case(name: str, tiny: bool, batch: int) -> Case:
    from disttrain_ds.families import BuildContext
    from disttrain_ds.families.vit.model import encoder_layers
    from disttrain_ds.models.pixels import pack_images
    from disttrain_ds.models.projectors import InputProjector

    cfg = EncoderConfig() if tiny else EncoderConfig(preset="vit-h-14", **ENCODER_PRESETS["vit-h-14"])
    if name == "vit448":
        cfg = replace(cfg, image_size=cfg.image_size * 2)
    width, p = PROJ_WIDTH[tiny], cfg.patch_size
    # vitmix: 1, 1.5 and 2 times the preset's side in turn (224, 336, 448 px for ViT-H/14).
    sides = [cfg.image_size * (2 + i % 3) // 2 // p * p if name.startswith("vitmix") else cfg.image_size
             for i in range(batch)]
    patches = [(side // p) ** 2 for side in sides]

    def inputs(device, dtype):
        g = torch.Generator().manual_seed(0)
        flat, hw = pack_images([torch.randn(3, side, side, generator=g) for side in sides])
        return (flat.to(device, dtype), hw.to(device)), None

    def flops() -> float:
        enc = vit_flops(layers=cfg.layers, hidden=cfg.hidden_size, ffn_hidden=cfg.ffn_hidden,
                        patches_per_image=patches, patch_size=p)
        proj = projector_flops_per_token(in_dim=cfg.hidden_size, hidden_dim=width, out_dim=width)
        return enc + proj * sum(patches)

    shape = (f"{batch} x {sides[0]}px ({patches[0]} patches)" if len(set(sides)) == 1 else
             f"{batch} images of {'/'.join(str(s) for s in sorted(set(sides)))}px ({sum(patches)} patches)")
    return Case(name, shape,
                lambda: [*(d.build() for d in encoder_layers(cfg, BuildContext("encoder", 0, width))),
                         InputProjector(cfg.hidden_size, width)],
                inputs, lambda out, _: out.float().square().mean(), flops,
                context=contextlib.contextmanager(_per_size) if name == "vitmix_groups" else contextlib.nullcontext)


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


DOC_PATHS = ("auto", "spans", "flex", "varlen")
"""``--doc-attention`` values (``model.<llm>.doc_attention``)."""


def build_cases(names: list[str], tiny: bool, seq_len: int, batch: dict[str, int], docs: int = 1,
                doc_attention: str = "auto", llm_layers: int | None = None) -> list[Case]:
    """The modules' cases; ``doc_attention``: one path, or several (comma list) for one LLM row per
    path side by side, named ``NAME [path]``."""
    out, paths = [], doc_attention.split(",")
    for name in names:
        if name.startswith("llm"):
            for path in paths:
                case = llm_case(name, tiny, seq_len, batch[name], docs, path, llm_layers)
                case.name = f"{name} [{path}]" if len(paths) > 1 else name
                out.append(case)
        elif name.startswith("vit"):
            out.append(vit_case(name, tiny, batch[name]))
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


def run_case(case: Case, device: torch.device, dtype: torch.dtype, steps: int, warmup: int,
             peak: float, backend: str, compile_: bool, accum: int = 1, master: bool = False,
             engine: bool = False) -> Result:
    res = Result(case.name + (" (engine)" if engine else ""), case.shape)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        layers = case.build()
    _drop_build_caches()
    if compile_:
        compile_layers(layers)  # in place, as train.compile does
    x, target = case.inputs(device, dtype)
    if engine:  # DeepSpeed's pipeline engine as the runtime configures it (fp32 master weights)
        from gpu_engine import engine_step  # deepspeed: only when asked for

        train_batch, model = engine_step(layers, case.loss, (x, target), device, dtype, accum)
    else:
        model = Sequential(layers).to(device=device, dtype=dtype)
        opt = Optimizer(model.parameters(), device, master)

        def train_batch() -> None:
            for _ in range(accum):
                case.loss(model(x), target).backward()
            opt.step()
    res.params = sum(p.numel() for p in model.parameters())

    def step() -> None:
        with _attention(backend), case.context():
            train_batch()

    measure = timer(device)
    for _ in range(warmup):
        measure(step)
    res.samples_ms = [measure(step) for _ in range(steps)]
    res.breakdown_ms = breakdown(step, device)
    res.step_ms = statistics.median(res.samples_ms)
    seconds = res.step_ms / 1e3
    flops = case.flops() * accum
    res.tflops = tflops_per_gpu(flops, 1, seconds)
    res.mfu = module_mfu(flops, 1, peak, seconds)
    res.mfu_full = module_mfu((case.flops_full or case.flops)() * accum, 1, peak, seconds)
    if case.tokens:
        res.tokens_per_s = case.tokens * accum / seconds
    if device.type == "cuda":
        res.peak_mem_gib = torch.cuda.max_memory_allocated(device) / 2**30
    return res


def _print_row(res: Result) -> None:
    print(f"{res.module:9s} {res.shape:44s} {res.step_ms:9.1f} ms {res.tflops:8.3g} TFLOP/s "
          f"MFU {res.mfu:6.1%} (full L^2 {res.mfu_full:6.1%})  {res.note}", flush=True)
    if res.breakdown_ms:
        total = sum(res.breakdown_ms.values()) or 1.0
        print("          one profiled step: " + ", ".join(f"{k} {v:.1f} ms ({v / total:.0%})"
                                                      for k, v in res.breakdown_ms.items()), flush=True)


def goal_note(res: Result, device_name: str) -> str:
    target = MFU_GOALS.get(res.module.split(" ")[0])  # bare and engine rows alike
    if target is None or res.mfu != res.mfu:
        return ""
    if not any(card.lower() in device_name.lower() for card in GOAL_CARDS):
        return f"goal >= {target:.0%} MFU on {' / '.join(GOAL_CARDS)} (this is {device_name})"
    return f"goal >= {target:.0%} MFU: {'met' if res.mfu >= target else 'MISSED'}"


def table(results: list[Result]) -> str:
    lines = ["| module | batch | params | step ms | TFLOP/s | MFU (causal L(L+1)/2) | MFU (full L^2) | tokens/s "
             "| peak mem GiB | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = "-" if r.peak_mem_gib != r.peak_mem_gib else f"{r.peak_mem_gib:.1f}"
        tok = "-" if r.tokens_per_s != r.tokens_per_s else f"{r.tokens_per_s:,.0f}"
        lines.append(f"| {r.module} | {r.shape} | {r.params / 1e6:.4g}M | {r.step_ms:.1f} | {r.tflops:.3g} "
                     f"| {r.mfu:.1%} | {r.mfu_full:.1%} | {tok} | {mem} | {r.note} |")
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
    ap.add_argument("--doc-attention", default="auto",
                    help=f"LLM: document attention path (model.<llm>.doc_attention: {', '.join(DOC_PATHS)}); "
                         "a comma list runs each side by side")
    ap.add_argument("--compile", action="store_true", help="compile each layer in place as train.compile does")
    ap.add_argument("--accum", type=int, default=1, help="microbatches per optimizer step (as gradient accumulation)")
    ap.add_argument("--master-fp32", action="store_true", help="fp32 master weights and AdamW moments (as training)")
    ap.add_argument("--engine", action="store_true",
                    help="also through DeepSpeed's pipeline engine as the runtime sets it up (bench/gpu_engine.py)")
    ap.add_argument("--llm-layers", type=int, default=8, help="decoder layers of the llm7b / llm13b stacks")
    ap.add_argument("--gemm", type=int, default=None, help="side of the ceiling GEMM (default 8192; 256 with --tiny)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak instead of the table's")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.modules.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODULES))
    if unknown or not names:
        raise SystemExit(f"--modules: unknown {unknown}; choose from {', '.join(MODULES)}")
    if bad := sorted(set(args.doc_attention.split(",")) - set(DOC_PATHS)):
        raise SystemExit(f"--doc-attention: unknown {bad}; choose from {', '.join(DOC_PATHS)}")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.docs < 1 or args.accum < 1 or args.llm_layers < 1:
        raise SystemExit("--docs, --accum and --llm-layers must be >= 1")
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
    card = card_info() if device.type == "cuda" else {}
    ceiling = gemm_ceiling(device, torch.bfloat16, args.gemm or (256 if args.tiny else 8192))
    states = "fp32 master weights and AdamW moments" if args.master_fp32 else "bf16 params/grads/AdamW states"
    print(f"device: {device_name}; peak {peak:.1f} TFLOP/s ({peak_src}); "
          + (f"SM clock {card.get('clocks.sm', '?')} (max {card.get('clocks.max.sm', '?')}), power limit "
             f"{card.get('power.limit', '?')}, driver {card.get('driver_version', '?')}; " if card else "")
          + f"bf16 GEMM ceiling {ceiling:.3g} TFLOP/s ({ceiling / peak:.0%} of peak); {states}, "
          f"{'fused' if device.type == 'cuda' else 'foreach'} AdamW once per {args.accum} microbatch(es); "
          f"{'compiled' if args.compile else 'eager'}; attention: {args.attention}, documents {args.doc_attention}; "
          f"torch {torch.__version__}")
    results = []
    for case in build_cases(names, args.tiny, seq_len, parse_batch(args.batch, args.tiny), args.docs,
                            args.doc_attention, args.llm_layers):
        try:
            for engine in (False, True) if args.engine else (False,):
                res = run_case(case, device, torch.bfloat16, args.steps, args.warmup, peak, args.attention,
                               args.compile, args.accum, args.master_fp32, engine)
                res.note = goal_note(res, device_name)
                results.append(res)
                _print_row(res)
        except torch.OutOfMemoryError:
            results.append(Result(case.name, case.shape, note="out of memory (lower --batch)"))
            _print_row(results[-1])
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"device": device_name, "peak_tflops": peak, "peak_source": peak_src,
                                         "card": card, "gemm_ceiling_tflops": ceiling, "accum": args.accum,
                                         "master_fp32": args.master_fp32, "compiled": args.compile, "engine": args.engine,
                                         "torch": torch.__version__, "results": [r.__dict__ for r in results]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
