#!/usr/bin/env bash
# Create .venv (if needed) and install hyfi-imaging with everything it needs, and what
# its checks need (the dev extra: ruff, mypy; the test extra: pytest; the zoo extra:
# torchvision and timm, whose models tests/test_zoo_mpi.py checks).
# Needs only python3 (>= 3.10) and pip. torch is pinned: an unpinned torch pulls
# gigabytes of CUDA packages on a CPU machine. On a GPU cluster, install the
# torch build that matches your CUDA first, then `pip install -e .` and use the
# site's MPI (see docs/user-guide.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.hyfi-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torchvision is pinned to the release built for this torch (the zoo extra is not pinned).
  .venv/bin/python -m pip install --quiet "torch==2.13.0" "torchvision==0.28.0" \
    -e ".[dev,test,mpich,zoo]"
  touch "$stamp"
fi
# The start-up hook that lets torchvision and timm import before hyfi_imaging (see
# hyfi_imaging/compat.py and setup.py): wheels carry it; the editable wheel does not, so it
# is written here, and again whenever compat.py changes.
hook=$(echo .venv/lib/python*/site-packages)/_hyfi_imaging_compat.py
if [ ! -f "$hook" ] || [ hyfi_imaging/compat.py -nt "$hook" ]; then
  .venv/bin/python -c "from hyfi_imaging.compat import write_startup_hook; write_startup_hook()"
fi
