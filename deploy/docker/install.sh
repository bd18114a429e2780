#!/usr/bin/env bash
# Installs Baton and its serving dependencies (not [dev]) into a new virtual environment, with the pins and the
# steps of `make venv`. The Dockerfile runs it, and so does tests/test_container_install.py, so that the image's
# install is exercised on machines that cannot build images.
# Usage: install.sh VENV SOURCE_DIR cuda|cpu   (PYTHON: the interpreter that creates the venv, python3 by default)
set -euo pipefail
if [ $# -ne 3 ] || { [ "$3" != cuda ] && [ "$3" != cpu ]; }; then
  echo "usage: $0 VENV SOURCE_DIR cuda|cpu" >&2
  exit 2
fi
venv=$1 src=$2 build=$3
pins="$(cd "$(dirname "${BASH_SOURCE[0]}")/../requirements" && pwd)/pins.env"
# Read as data, not sourced: a value such as torch>=2.9 would be a redirection to the shell.
while IFS= read -r line || [ -n "$line" ]; do
  case $line in '' | '#'*) continue ;; esac
  printf -v "${line%%=*}" '%s' "${line#*=}"
done <"$pins"
if [ "$build" = cuda ]; then torch=$TORCH_GPU; else torch=$TORCH_CPU; fi

"${PYTHON:-python3}" -m venv "$venv"
py=$venv/bin/python
# pip's own retries and resumed downloads for a flaky network, as in the Makefile.
opts=(--retries 10 --resume-retries 20)
pip_install() {
  echo "pip install $*"
  "$py" -m pip install -q "$@"
}
# Older pips (as ensurepip brings) lack --resume-retries.
pip_install --upgrade pip
pip_install "${opts[@]}" "$torch"
# Pin the torch just installed so that nothing below replaces it with another build.
"$py" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$venv/constraints.txt"
pip_install "${opts[@]}" -c "$venv/constraints.txt" "$src"
pip_install "${opts[@]}" -c "$venv/constraints.txt" "$NIXL_CORE"
pip_install "${opts[@]}" --no-deps "$NIXL_FRONT"
"$py" -c "import triton" 2>/dev/null || pip_install "${opts[@]}" --no-deps "$TRITON_CPU"
