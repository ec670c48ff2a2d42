#!/usr/bin/env bash
# The Python packages `dynsnap agent exec` imports, as cp312 manylinux wheels for the GPU machine's python3
# (no network there): into .device/wheels, carried with the GPU scripts (bench/gpu/agent_h200.sh and those
# that copy it install them with pip --no-index). Versions are pyproject.toml's pins; run after a change to
# them or to what the agent's exec path imports (a missing one shows as ModuleNotFoundError in the agent's
# stderr, and the GPU script exits non-zero). Usage (repository root, this machine): bench/gpu/pack_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source <(./run env | sed 's/^/export /')
pin() { grep -oE "\"$1==[^\"]+\"" pyproject.toml | tr -d '"'; }
rm -rf .device/wheels && mkdir -p .device/wheels
"$DYNSNAP_VENV/bin/python" -m pip download -q -d .device/wheels --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --implementation cp \
  "$(pin pydantic)" "$(pin PyYAML)" "$(pin tenacity)" "$(pin httpx)" "$(pin prometheus-client)"
ls .device/wheels
