#!/usr/bin/env python
"""Export from a checkout: ``disttrain-export`` without installing (see ``disttrain_ds/cli/export.py``).

    python tools/export.py --checkpoint checkpoints/tiny_cpu/step_00000020 --out exported/tiny_cpu [--dtype bf16]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_ds.cli.export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
