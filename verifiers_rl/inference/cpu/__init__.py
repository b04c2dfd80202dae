"""The CPU inference server: our engines (a slot engine for Llama-family models, transformers' continuous batching
for the rest) behind the same HTTP routes and weight-sync payloads as vLLM."""
