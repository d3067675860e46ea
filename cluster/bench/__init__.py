"""Benchmarks: `kvblend bench tiers|blend|cluster|vllm|gpu`, each against its baseline in one run."""
