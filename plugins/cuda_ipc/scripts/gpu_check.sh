#!/usr/bin/env bash
# cuda_ipc on a GPU machine, in one go: install the wheels in .whl/ if there are any (below);
# run the cuda_ipc tests and the conformance kit (default: staged copies with the fused
# Triton kernels; again with KVXFER_CUDA_IPC_MODE=direct; the cuda_ipc tests with the per-layer
# torch ops), the copy diagnostics, and the benchmark (staged vs cpu_gather, then direct).
# Run from the checkout's root; logs and JSON go to $OUT (default ./gpu-out).
#   bash plugins/cuda_ipc/scripts/gpu_check.sh
# On a GPU host without network, put the wheels of this checkout (`pip wheel --no-deps -w .whl . plugins/*/`)
# and of its dependencies (pyzmq, msgspec, pluggy, stevedore) in .whl/ first: the script
# installs them into /tmp/site; with network, install them with pip instead.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, kvxfer_cuda_ipc as k; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0)); print(k.CudaIpcTransport().probe())"
  echo "ulimit -l: $(ulimit -l)"
} 2>&1 | tee "$OUT/env.txt"
rc=0
tests() {  # label, env assignment, pytest paths...
  local label=$1 envset=$2; shift 2
  echo "=== tests: $label ($envset)" | tee -a "$OUT/tests.log"
  env $envset timeout 150 python3 -m pytest -q -rs "$@" 2>&1 | tee -a "$OUT/tests.log" || rc=1
}
tests staged-triton KVXFER_CUDA_IPC_MODE=staged plugins/cuda_ipc/tests
tests direct-triton KVXFER_CUDA_IPC_MODE=direct plugins/cuda_ipc/tests
tests staged-torch-ops KVXFER_CUDA_IPC_KERNEL=torch plugins/cuda_ipc/tests/test_cuda_ipc.py
timeout 60 python3 plugins/cuda_ipc/scripts/probe_copies.py 2>&1 | tee "$OUT/probe_copies.log" || rc=1
timeout 100 python3 benchmarks/cuda_ipc.py --transports cuda_ipc cpu_gather --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" || rc=1
KVXFER_CUDA_IPC_MODE=direct timeout 80 python3 benchmarks/cuda_ipc.py --json "$OUT/bench_direct.json" 2>&1 \
  | tee "$OUT/bench_direct.log" || rc=1
exit $rc
