#!/usr/bin/env bash
# The hpu transport on a GPU machine, with CUDA standing in for Gaudi. Run from the repository root:
#     bash plugins/hpu/scripts/gpu_check.sh
# On a GPU host without network, put the wheels of this checkout (`pip wheel --no-deps -w .whl . plugins/*/`)
# and of its dependencies (pyzmq, msgspec, pluggy, stevedore) in .whl/ first: the script
# installs them into /tmp/site; with network, install them with pip instead.
# Installs the wheels, records the machine, runs the hpu tests (the conformance kit with cuda
# tensors through this transport, and the plugin's own tests), then the benchmark on cuda (default
# 32 MiB gather buffer, then 128 and 256 MiB: 4 chunks and a whole request per index kernel) and
# on that machine's CPU.
# Logs and JSON go to $OUT (default /tmp/hpu-gpu-check), at most 8 files. Exits non-zero if the tests or a benchmark failed.
set -uo pipefail
out=${OUT:-/tmp/hpu-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, kvxfer_hpu; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0)); print(kvxfer_hpu.HpuTransport().probe())'
  nproc
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

python3 -m pytest -q -rs plugins/hpu/tests 2>&1 | tee "$out/tests.log"
rc=${PIPESTATUS[0]}
echo "tests rc=$rc" > "$out/summary.txt"

bench() {  # name, args...: the table goes to bench.log, the JSON to $out/hpu-<name>.json
  local name=$1; shift
  python3 benchmarks/hpu.py "$@" --json "$out/hpu-$name.json" 2>"/tmp/bench-$name.progress" | tee -a "$out/bench.log"
  local r=${PIPESTATUS[0]}
  echo "bench $name rc=$r" | tee -a "$out/summary.txt"
  [[ $r == 0 ]] || { rc=$r; tail -20 "/tmp/bench-$name.progress"; }
}
bench cuda --device cuda
bench cuda-group128 --device cuda --transports hpu --group-mib 128
bench cuda-group256 --device cuda --transports hpu --group-mib 256
bench cpu --device cpu --requests 8
cat "$out/summary.txt"
exit "$rc"
