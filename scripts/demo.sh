#!/usr/bin/env bash
# The main job: set up .venv if needed, start a server with the default transport (cpu_gather),
# store and load a real paged KV cache, verify it, report, stop the server.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh" --no-system-packages  # (stunnel4 is for the tests alone)
exec "$root/.venv/bin/kvxfer" demo "$@"
