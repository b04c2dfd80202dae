"""How a sync's bytes reach the server: gloo (`gloo`: the group and the requests; `wire`: buckets on the wire;
`shm`: a bucket through shared memory on one host), LoRA adapters over gloo (`adapter`), vLLM's NCCL engines
(`nccl`, `nccl_init`, under `watchdog`) and changed elements over NCCL (`sparse_nccl`). One sender per backend
(sync/sender.py's interface), picked by sync/backends.py."""
