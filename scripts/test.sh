#!/usr/bin/env bash
# Set everything up, then run the checks CI runs: ruff (format + lint), mypy, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
ruff format --check hyfi_imaging tests benchmarks
ruff check hyfi_imaging tests benchmarks
mypy
pytest -q -p no:cacheprovider --timeout=600 --durations=25 "$@"
