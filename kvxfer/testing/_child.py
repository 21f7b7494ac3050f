"""A client process for the dead-client test: registers one small KV cache, prints
``registered <instance_id>``, then waits to be killed (exits by itself after ``--linger`` s)."""

from __future__ import annotations

import argparse
import time

from kvxfer.client import CacheClient
from kvxfer.layout import LayoutKind
from kvxfer.testing.harness import TIMEOUT
from kvxfer.testing.kvdata import KVSpec, make_kv


def main() -> None:
    p = argparse.ArgumentParser()
    for opt in ("--url", "--transport", "--device", "--model", "--layout", "--dtype"):
        p.add_argument(opt, required=True)
    p.add_argument("--linger", type=float, default=120.0)
    args = p.parse_args()
    spec = KVSpec(LayoutKind(args.layout), args.dtype)
    layers = make_kv(spec, args.device)
    client = CacheClient(args.url, timeout=TIMEOUT, name="kvxfer-conformance-child")
    ctx = client.register(layers, model_name=args.model, block_size=spec.block_size,
                          transport=args.transport, layout=spec.kind)
    print(f"registered {ctx.instance_id}", flush=True)
    time.sleep(args.linger)


if __name__ == "__main__":
    main()
