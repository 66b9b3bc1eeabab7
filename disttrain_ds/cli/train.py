"""Train a multimodal LLM from a recipe (a shipped recipe's name, or a YAML path).

    disttrain-train --recipe tiny_cpu [key=value ...]
    python tools/train.py --recipe recipes/tiny_cpu.yaml [key=value ...]
    torchrun --standalone --nproc_per_node=4 tools/train.py --recipe recipes/tiny_cpu.yaml layout=disaggregated
    deepspeed --num_gpus 4 tools/train.py --recipe recipes/tiny_cpu.yaml layout=disaggregated
    torchrun --standalone --nproc_per_node=4 -m disttrain_ds.cli.train --recipe tiny_cpu layout=disaggregated
    torchrun --nnodes=1:2 --max-restarts=3 ... tools/train.py --elastic profile.json --recipe ...   # re-plans
    disttrain-train --recipe mllm_9b --dry-run        # rank map and each rank's estimated peak memory

In a multi-process job only rank 0 prints (rank map, data, recipe, steps); library output goes
to <run dir>/logs/rank<N>.log and failures to standard error.
"""

from __future__ import annotations

import argparse
import os
import sys

from disttrain_ds.console import tell_launcher
from disttrain_ds.errors import ConfigError, TrainingDiverged
from disttrain_ds.runtime.entry import dry_run, run


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True,
                        help="shipped recipe name (e.g. tiny_cpu) or recipe YAML path")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the rank map and each rank's estimated peak memory against "
                             "train.device_memory_gib, start nothing; exit 2 if a rank does not fit")
    parser.add_argument("--elastic", metavar="PROFILE", default=None,
                        help="torchrun --nnodes=MIN:MAX: when a restart brings another number of ranks than the "
                             "recipe lays out, re-plan it for them from this planner profile and resume from the "
                             "newest checkpoint (docs/reliability.md)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5 layout=disaggregated")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 with one line on stderr for a bad recipe, 1 for a
    loss that is not finite)."""
    args = build_parser().parse_intermixed_args(argv)
    # Set before torch is imported: several ranks on few cores crawl without it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    try:
        if args.dry_run:
            return dry_run(args.recipe, args.overrides)
        return run(args.recipe, args.overrides, elastic=args.elastic)
    except ConfigError as exc:
        tell_launcher(f"error: {exc}")  # torchrun's failure summary shows it as the root cause
        if os.environ.get("RANK", "0") == "0":  # every rank hits the same error: say it once
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:  # the reference layout (distributed ranks end in runtime/health.py)
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
