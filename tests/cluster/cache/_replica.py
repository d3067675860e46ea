"""A second client process (standing in for another vLLM replica), run by test_multiprocess.

Usage: python -m tests.cluster.cache._replica ADDRESS RAY_NAMESPACE put|check FIRST COUNT
Prints one JSON line with what it saw; exit code 0 on success.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    address, ray_ns, mode, first, count = sys.argv[1:6]
    first, count = int(first), int(count)
    from cluster.cache.client import CacheClient
    from cluster.config import load_config
    from tests.factories import NAMESPACE, make_key, shard_kv

    cfg = load_config(environ={}, overrides={"ray_address": address, "ray_namespace": ray_ns,
                                             "call_timeout_s": 10.0, "load_timeout_s": 10.0})
    client = CacheClient(cfg, NAMESPACE)
    keys = [make_key(i) for i in range(first, first + count)]
    if mode == "put":
        for i, k in zip(range(first, first + count), keys, strict=True):
            client.put(k, shard_kv(i))
        ok = client.flush(60)
        print(json.dumps({"flushed": ok}))
        return 0 if ok else 1
    metas = client.lookup(keys)
    layers = client.fetch_layer(keys, 2).result(60)
    equal = [t is not None and torch.equal(t, shard_kv(i)[2])
             for i, t in zip(range(first, first + count), layers, strict=True)]
    print(json.dumps({"hits": sum(m is not None for m in metas), "equal": sum(equal)}))
    return 0 if all(equal) else 1


if __name__ == "__main__":
    sys.exit(main())
