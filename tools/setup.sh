#!/usr/bin/env bash
# Create ./.venv with the pinned requirements and the package (idempotent, ~2 minutes the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.requirements.sha
want=$(cat requirements.txt requirements-dev.txt requirements-nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first and pinned, so no later resolver step can pull a CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
echo "$want" > "$stamp"
echo "environment ready: .venv"
