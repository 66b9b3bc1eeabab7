"""Export a training checkpoint to Hugging Face / diffusers model directories.

    disttrain-export --checkpoint checkpoints/tiny_cpu/step_00000020 --out exported/tiny_cpu [--dtype bf16]

(``python tools/export.py ...`` in a checkout is the same command.) Writes ``<out>/<module>/`` per
module: ``save_pretrained`` of the module's transformers / diffusers model (ViT, Llama, Qwen2,
Whisper encoder, U-Net, PixArt DiT), its projector as ``projector.safetensors`` with
``projector.json``, and for the LLM ``tokens.json`` and the tokenizer's files. Any layout (DP, TP,
PP) exports the same tensors. The checkpoint is verified against its manifest first; ``--out``
must not exist or be empty. Bad input: one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from disttrain_ds.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="disttrain-export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint step directory (step_XXXXXXXX)")
    ap.add_argument("--out", required=True, help="new directory for the exported modules")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="tensor dtype written (default fp32)")
    args = ap.parse_args(argv)
    # deferred: loads torch (safetensors too)
    from disttrain_ds.checkpoint.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
