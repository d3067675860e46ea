"""Benchmarks: `kvblend bench tiers|blend|cluster|vllm|gpu`, each against its baseline in one run.

`tiers` times tier reads and writes against plain copies, `blend` CacheBlend's quality and TTFT
against full prefill on a QA set, `cluster` shard lookups and client layer reads against bare
Ray calls and direct reads, `vllm` TTFT through vLLM with and without the connector, and `gpu`
blend TTFT on a GPU over the gpu, host and disk tiers (its harness in `gpu_harness`, its default
model `blend.adapters.fused_llama`). Each command module has `add_arguments` and `run`, imports
its heavy dependencies inside `run`, and imports no CLI module.
"""
