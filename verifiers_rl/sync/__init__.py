"""Stage 8, weight sync: the trainer's weights into the server after each step. `policy_sync` decides when (and
owns the served version); `export`, `policy_weights` and `shard_gather` make the tensors in the server's names
from any parallel layout; `stream` and `buckets` describe and pack them; `delta` sends changed elements only;
`verify` and `guard` check what landed. The bytes move in `transport/`; the receivers live in the servers
(inference/vllm/gloo_engine.py, inference/cpu/weight_receiver.py)."""
