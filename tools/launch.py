#!/usr/bin/env python
"""Check a hostfile against a recipe (slots, reachable hosts), then start the deepspeed launcher.

    python tools/launch.py --hostfile hostfile --recipe recipes/tiny_cpu.yaml layout=disaggregated
    python tools/launch.py --hostfile hostfile --dry-run --recipe recipes/mllm_9b.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_ds.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(train_script=Path(__file__).resolve().parent / "train.py"))
