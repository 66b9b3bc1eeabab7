#!/usr/bin/env python
"""Launch from a checkout: ``disttrain-launch`` without installing, starting ``tools/train.py``
on every node (see ``disttrain_ds/cli/launch.py``).

    python tools/launch.py --hostfile hostfile --recipe recipes/tiny_cpu.yaml layout=disaggregated
    python tools/launch.py --hostfile hostfile --dry-run --recipe recipes/mllm_9b.yaml
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_ds.cli.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(train_script=Path(__file__).resolve().parent / "train.py"))
