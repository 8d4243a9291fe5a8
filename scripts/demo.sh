#!/usr/bin/env bash
# Set everything up, then run the demo on built-in synthetic slides (CPU, a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
hyfi-demo --out "${1:-demo_out}"
