#!/usr/bin/env bash
# All tests of the core, every plugin and the example plugin: set up .venv if needed, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -x -k lookup).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
