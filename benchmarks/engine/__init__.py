"""The offline engine (the `LLM` API): throughput, tensor parallelism, quantized models, adapters, accuracy."""
