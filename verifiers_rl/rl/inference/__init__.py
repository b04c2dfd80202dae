"""verifiers 0.1.14 import path: `verifiers_rl.rl.inference.client` (VLLMClient) and `.server` (vf-vllm's main) are
aliases of `verifiers_rl.serving.client` and `verifiers_rl.inference.server`."""
