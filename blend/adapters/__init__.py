"""Model adapters implementing :class:`blend.protocols.BlendModel`.

``hf`` wraps Hugging Face transformers causal LMs (Llama, Mistral, Qwen2; SmolLM2 is Llama)
for tests and the benchmark; ``hf_tp`` shards such a model Megatron-style across
tensor-parallel ranks (each rank blends its own KV heads). Adapters reuse the framework's own modules and cut each decoder
layer at CacheBlend's seams (qkv with RoPE; attention by the engine; the rest of the layer).
"""
