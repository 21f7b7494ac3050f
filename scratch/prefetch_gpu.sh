#!/usr/bin/env bash
# GPU: cuda_ipc tests (prefetch included), prefix loads with and without prefetch, a traced lone
# load with prefetch; one call.
set -uo pipefail
D=$OUT; W=/tmp/pf; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $W/install.log 2>&1 || { cat $W/install.log; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $W/env.txt
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider plugins/cuda_ipc/tests 2>&1 | tail -15 | tee $W/tests.txt
for r in 1 2; do
  for t in cuda_ipc hpu; do
    echo "=== round $r prefix $t" | tee -a $W/log.txt
    timeout 120 python3 -m kvxfer bench --prefix --transport $t --device cuda --prefix-chunks 1 8 --iters 20 --prefetch \
      --json $W/prefix-$t-r$r.json 2>&1 | grep -v "prefix $t:" | tee -a $W/log.txt
  done
done
echo "=== lone trace prefetch" | tee -a $W/log.txt
timeout 120 python3 benchmarks/lone_trace.py --transport cuda_ipc --device cuda --chunks 8 --iters 30 --prefetch \
  --json $W/trace-prefetch.json 2>&1 | grep -v "lone requests" | tee -a $W/log.txt
tar czf $D/pf.tgz -C $W .
