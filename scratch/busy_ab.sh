#!/usr/bin/env bash
# A/B of kvxfer serve --busy-poll-us on the GPU host, alternating, one call.
set -uo pipefail
D=$OUT; W=/tmp/ab; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $W/install.log 2>&1 || { cat $W/install.log; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv; nproc; cat /proc/cpuinfo | grep "model name" | head -1; uname -a; } > $W/env.txt 2>&1
cat $W/env.txt
timeout 120 python3 benchmarks/host_steps.py --iters 300 --gap-ms 5 --json $W/ 2>&1 | grep -v "host steps:" | tee $W/log.txt
for r in 1 2; do
  for bp in 0 20000; do
    echo "=== round $r busy $bp prefix cuda_ipc" | tee -a $W/log.txt
    timeout 100 python3 -m kvxfer bench --prefix --transport cuda_ipc --device cuda --prefix-chunks 1 8 --iters 20 \
      --busy-poll-us $bp --json $W/prefix-cuda_ipc-r$r-bp$bp.json 2>&1 | grep -v "prefix cuda_ipc:" | tee -a $W/log.txt
    echo "=== round $r busy $bp bench cuda_ipc" | tee -a $W/log.txt
    timeout 100 python3 -m kvxfer bench --transport cuda_ipc --device cuda --blocks 1024 --chunks-per-request 8 \
      --inflight 1 --iters 12 --busy-poll-us $bp --json $W/bench-cuda_ipc-r$r-bp$bp.json 2>&1 | grep -v "chunk 256:" | tee -a $W/log.txt
  done
done
for bp in 0 20000; do
  echo "=== busy $bp prefix hpu" | tee -a $W/log.txt
  timeout 100 python3 -m kvxfer bench --prefix --transport hpu --device cuda --prefix-chunks 1 8 --iters 20 \
    --busy-poll-us $bp --json $W/prefix-hpu-bp$bp.json 2>&1 | grep -v "prefix hpu:" | tee -a $W/log.txt
done
for g in 5 50; do
  echo "=== lone trace busy 20000 gap $g" | tee -a $W/log.txt
  timeout 120 python3 benchmarks/lone_trace.py --transport cuda_ipc --device cuda --chunks 8 --iters 30 --gap-ms $g \
    --busy-poll-us 20000 --json $W/trace-bp20000-gap$g.json 2>&1 | grep -v "lone requests" | tee -a $W/log.txt
done
tar czf $D/ab.tgz -C $W .
