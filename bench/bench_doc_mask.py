"""Document-masked attention: ways to keep attention inside each packed document, side by side.

    python bench/bench_doc_mask.py [--seq 2048] [--docs 4] [--heads 8] [--head-dim 64] [--device cpu|cuda]

For one packed sequence of ``--docs`` equal documents it times forward + backward of one attention
call and counts the bytes autograd keeps for backward, for:

- ``causal (no doc mask)``: SDPA ``is_causal`` over the whole pack, documents attending across
  each other (what the model computed before document masking; the speed to beat);
- ``sdpa bool mask``: SDPA with the [S, S] boolean mask of ``models/doc_mask.py``;
- ``sdpa additive mask``: the same mask as 0 / -inf floats;
- ``doc_attention (spans)``: SDPA ``is_causal`` on each document's span, spans of equal length
  batched (``models/doc_mask.py::doc_attention``, what the LLM uses: a variable-length kernel's
  work, no mask);
- ``flex_attention``: torch's flex attention with a block mask from ``create_block_mask``,
  compiled; it has no backward on CPU;
- ``doc_attention (flex)``: the same through ``doc_attention`` as the LLM calls it on CUDA (block
  mask from ``doc_block_mask``, the module-level compiled kernel).

Each row also checks its output against the boolean-mask row. With flex it also prints how long
building each block mask takes (done once per microbatch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from disttrain_ds.models.doc_mask import doc_attention, doc_block_mask, doc_causal_mask, doc_spans
from disttrain_ds.samples import doc_ids


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def timed(fn, device: str, steps: int) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls after one warm-up call."""
    times = []
    for i in range(steps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fwd_bwd(fn, leaves):
    """One forward + backward of ``fn``, gradients reset first."""
    def step():
        for t in leaves:
            t.grad = None
        fn().sum().backward()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-flex", action="store_true", help="skip flex attention (its compile takes a while)")
    args = ap.parse_args()
    dev, s = args.device, args.seq
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, s, args.head_dim, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
    lens = [s // args.docs] * args.docs
    lens[-1] += s - sum(lens)
    docs = doc_ids(tuple(lens), s).unsqueeze(0).to(dev)
    mask = doc_causal_mask(docs)
    additive = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill(~mask, float("-inf"))
    spans = doc_spans(docs)

    def per_doc() -> torch.Tensor:
        return doc_attention(None, q, k, v, None, doc_spans=spans)[0].transpose(1, 2)

    variants = {
        "causal (no doc mask)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa additive mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        "doc_attention (spans)": per_doc,
    }
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            d0 = docs[0]

            def build_raw():
                return create_block_mask(lambda b, h, i, j: (d0[i] == d0[j]) & (i >= j), 1, None, s, s, device=dev)

            block = build_raw()
            compiled = torch.compile(flex_attention)
            variants["flex_attention"] = lambda: compiled(q, k, v, block_mask=block)
            ours = doc_block_mask(docs)
            variants["doc_attention (flex)"] = lambda: doc_attention(None, q, k, v, None, doc_blocks=ours)[0].transpose(1, 2)
            for name, build in (("create_block_mask", build_raw), ("doc_block_mask", lambda: doc_block_mask(docs))):
                print(f"block mask build, {name}: {timed(build, dev, args.steps) * 1e3:.2f} ms")
        except Exception as exc:  # noqa: BLE001 - reported as a row
            print(f"flex_attention: unavailable ({type(exc).__name__}: {exc})")

    print(f"device {dev}, {dtype}, 1 x {args.heads} heads x {s} tokens x {args.head_dim}, {args.docs} documents")
    print(f"{'variant':24s} {'fwd+bwd ms':>11s} {'saved MiB':>10s} {'max |diff|':>11s}")
    ref = variants["sdpa bool mask"]().detach().float()
    for name, fn in variants.items():
        try:
            out, saved = saved_bytes(fn)
            diff = (out.detach().float() - ref).abs().max().item()
            ms = timed(fwd_bwd(fn, (q, k, v)), dev, args.steps) * 1e3
        except Exception as exc:  # noqa: BLE001 - e.g. flex attention's missing CPU backward
            print(f"{name:24s} {'-':>11s} {'-':>10s} {'-':>11s}  ({type(exc).__name__}: {str(exc).splitlines()[0][:70]})")
            continue
        print(f"{name:24s} {ms:11.2f} {saved / 2**20:10.2f} {diff:11.2e}")


if __name__ == "__main__":
    main()
