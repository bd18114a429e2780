#!/usr/bin/env bash
# Fetch the reference Mamba2 Triton kernels (state-spaces/mamba: the mamba_ssm 2.2.4 sdist, 92 KB) into .ref/ for
# benchmarks/scan_bench.py, through pip's configured index with the sdist's hash checked. Nothing is built or
# installed (its metadata step skips the CUDA extension); .ref/ is not committed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
if [ ! -d .ref/mamba_ssm-2.2.4 ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "mamba_ssm==2.2.4 --hash=sha256:e4114c69302796c91b71e90032c2d974f611608fab331582a80de6eaf075efb9" >"$tmp/req.txt"
  # No build isolation: the metadata step imports torch, which the venv has and an isolated build would download.
  MAMBA_SKIP_CUDA_BUILD=TRUE "$python" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
    --require-hashes -r "$tmp/req.txt" -d "$tmp"
  mkdir -p .ref
  tar xzf "$tmp/mamba_ssm-2.2.4.tar.gz" -C .ref
fi
echo ".ref/mamba_ssm-2.2.4"
