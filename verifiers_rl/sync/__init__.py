"""Stage 8, weight sync: the trainer's weights into the server after each step. The core here decides what to
send and when: `policy_sync` (the one owner of the served version, `policy_version`), `export` and
`policy_weights` (the policy's tensors in the server's names, any parallel layout; `shard_gather` brings shards
to rank 0 on the CPU), `stream` and `buckets` (one sync's tensors, described up front, packed in buckets),
`delta` (changed elements only), `verify` and `guard` (what landed is what the trainer holds). The bytes move
in `transport/` (gloo, shared memory, NCCL); the receivers live in the servers (inference/vllm/gloo_engine.py,
inference/cpu/weight_receiver.py)."""
