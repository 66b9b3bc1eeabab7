#!/usr/bin/env python
"""Report from a checkout: ``disttrain-report`` without installing (see ``disttrain_ds/cli/report.py``).

    python tools/report.py runs/tiny_cpu [--html] [--out DIR]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_ds.cli.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
