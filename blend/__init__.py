"""CacheBlend: reuse the KV cache of text chunks wherever they appear in a prompt (Yao et al., EuroSys 2025).

``segments`` and ``planner`` split a prompt at its separators and build an immutable
``BlendPlan`` (chunk keys, hits and misses, check layers and recompute ratios) from one
batched lookup; ``rope``, ``selection`` and ``attention`` are the math (re-rotation of cached
K, KV-deviation token selection, causal attention of scattered query rows). ``engine`` runs the
plan layer by layer against the ``BlendModel`` and ``KVSource`` protocols (``protocols``) and
returns a ``BlendResult`` with its counters (``result``); ``ops`` and ``kernels`` are its fast
paths (Triton/FlexAttention on CUDA beside plain-torch references), ``adapters`` its models
(Hugging Face transformers here, vLLM in the cluster).
"""
