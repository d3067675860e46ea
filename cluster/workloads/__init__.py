"""What runs on top of the cache: the bundled model, QA data, vLLM replicas, ingest and the demo.

`model` prepares the bundled SmolLM2 as a Hugging Face folder, `qa` reads the MuSiQue and
2WikiMultihopQA sets, `replicas` starts ``vllm serve`` processes with the connector,
`services` starts local Redis and S3 servers, `ingest` stores a corpus's canonical KV and
`demo` is the main job (a RAG workload through replicas sharing one cache).
"""
