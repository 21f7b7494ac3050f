#!/usr/bin/env bash
# ruff (rules and the reason for each ignore: pyproject.toml [tool.ruff]) and mypy ([tool.mypy])
# over the core, every plugin and the example plugin. Sets up .venv if needed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check kvxfer plugins/*/kvxfer_* examples/*/kvxfer_*
.venv/bin/mypy
