#!/usr/bin/env bash
# cuda_ipc on a GPU machine, in one go: install the wheels of ../shared/tools/device-wheels (.whl/,
# carried), run the cuda_ipc tests and the conformance kit, the copy diagnostics and the benchmark
# (fused Triton copy kernels, then the per-layer torch ops). Run from the checkout's root; logs
# and JSON go to $OUT (default ./gpu-out).
#   device tool: run(command="bash plugins/cuda_ipc/scripts/gpu_check.sh", carry=[".whl"])
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
timeout 240 python3 -m pytest -q -rs plugins/cuda_ipc/tests 2>&1 | tee "$OUT/tests.log" || rc=1
KVXFER_CUDA_IPC_KERNEL=torch timeout 120 python3 -m pytest -q -rs plugins/cuda_ipc/tests/test_cuda_ipc.py 2>&1 \
  | tee "$OUT/tests_torch_kernel.log" || rc=1
timeout 60 python3 plugins/cuda_ipc/scripts/probe_copies.py 2>&1 | tee "$OUT/probe_copies.log" || rc=1
timeout 150 python3 benchmarks/cuda_ipc.py --transports cuda_ipc cpu_gather --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" || rc=1
KVXFER_CUDA_IPC_KERNEL=torch timeout 100 python3 benchmarks/cuda_ipc.py --json "$OUT/bench_torch_kernel.json" 2>&1 \
  | tee "$OUT/bench_torch_kernel.log" || rc=1
exit $rc
