#!/usr/bin/env bash
# The hpu transport on the GPU machine of the device tool, with CUDA standing in for Gaudi.
# Run from the repository root after ../shared/tools/device-wheels, with carry [".whl"]:
#     bash plugins/hpu/scripts/gpu_check.sh
# Installs the wheels, records the machine, runs the hpu tests (the conformance kit with cuda
# tensors through this transport, and the plugin's own tests), then the benchmark on cuda (and on
# that machine's CPU). Logs and JSON go to $OUT (default /tmp/hpu-gpu-check). Exits non-zero if
# the tests or a benchmark failed.
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
rc_tests=${PIPESTATUS[0]}

python3 benchmarks/hpu.py --device cuda --json "$out/hpu-cuda.json" 2>/tmp/bench-cuda.progress | tee "$out/bench-cuda.log"
rc_cuda=${PIPESTATUS[0]}
python3 benchmarks/hpu.py --device cpu --requests 8 --json "$out/hpu-cpu.json" 2>/tmp/bench-cpu.progress | tee "$out/bench-cpu.log"
rc_cpu=${PIPESTATUS[0]}

echo "tests rc=$rc_tests, bench cuda rc=$rc_cuda, bench cpu rc=$rc_cpu" | tee "$out/summary.txt"
[[ $rc_tests == 0 && $rc_cuda == 0 && $rc_cpu == 0 ]]
