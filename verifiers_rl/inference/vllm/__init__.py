"""The code real vLLM loads from this package (the gloo weight-transfer plugin, the LoRA worker extension); its
command line is inference/vllm_command.py. Nothing here imports vLLM at module level."""
