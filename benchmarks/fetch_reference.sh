#!/usr/bin/env bash
# Fetch the reference Mamba2 Triton kernels (state-spaces/mamba, mamba_ssm 2.2.4 sdist from PyPI, 92 KB) into
# .ref/ for benchmarks/scan_bench.py. Nothing is built or installed; .ref/ is not committed.
set -euo pipefail
cd "$(dirname "$0")/.."
url=https://files.pythonhosted.org/packages/1d/c7/6e21ecece28e6d625f42e708c7523cd78ec82d1622f98562f82bf02748b7/mamba_ssm-2.2.4.tar.gz
mkdir -p .ref
[ -d .ref/mamba_ssm-2.2.4 ] || curl -sSL "$url" | tar xz -C .ref
echo ".ref/mamba_ssm-2.2.4"
