"""Real vLLM as the RL inference server: its command line, and the code vLLM loads from this package (the gloo
weight-transfer plugin, the LoRA worker extension). Nothing here imports vLLM at module level."""
