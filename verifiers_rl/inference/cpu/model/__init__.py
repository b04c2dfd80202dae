"""The model the CPU engines run: built from the checkpoint without transformers' modeling code (`lean_model`),
its forward over a slot KV cache (`lean_forward`, `kv_cache`; the slot engine), and per-request attention for
transformers' continuous batching (`varlen_attention`; cb_engine.py)."""
