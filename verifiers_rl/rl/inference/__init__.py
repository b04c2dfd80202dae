"""Inference: engines (vLLM on GPU, our continuous-batching engine on CPU), their client and weight sync."""
