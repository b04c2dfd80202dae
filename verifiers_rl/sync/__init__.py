"""Stage 8, weight sync: the trainer's weights into the server after each step. Export the policy's weights in the
server's names (`export`, gathering shards under FSDP2/ZeRO-3), pack them in buckets (`buckets`, `wire`), send them
over gloo or NCCL (`gloo`, `nccl`, `sender`, `stream`), verify that what landed is what the trainer holds
(`verify`), and track which policy version the server serves (`policy_sync`, `policy_version`, `guard`)."""
