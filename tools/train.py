#!/usr/bin/env python
"""Train a multimodal LLM from a recipe.

    python tools/train.py --recipe recipes/tiny_cpu.yaml [key=value ...]
    torchrun --standalone --nproc_per_node=4 tools/train.py --recipe recipes/tiny_cpu.yaml layout=disaggregated
    deepspeed --num_gpus 4 tools/train.py --recipe recipes/tiny_cpu.yaml layout=disaggregated
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # several ranks on few cores crawl without this

from disttrain_ds.configtools import ConfigError  # noqa: E402
from disttrain_ds.entry import run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5 layout=disaggregated")
    args = parser.parse_args(argv)
    try:
        return run(args.recipe, args.overrides)
    except ConfigError as exc:
        if os.environ.get("RANK", "0") == "0":  # every rank hits the same error: say it once
            print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
