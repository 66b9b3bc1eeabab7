#!/usr/bin/env python
"""Train from a checkout: ``disttrain-train`` without installing (see ``disttrain_ds/cli/train.py``).

    python tools/train.py --recipe recipes/tiny_cpu.yaml [key=value ...]
    torchrun --standalone --nproc_per_node=4 tools/train.py --recipe recipes/tiny_cpu.yaml layout=disaggregated
    deepspeed --num_gpus 4 tools/train.py --recipe recipes/tiny_cpu.yaml layout=disaggregated
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_ds.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
