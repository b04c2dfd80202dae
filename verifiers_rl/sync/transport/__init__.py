"""How a sync's bytes reach the server, one sender per backend (picked by sync/backends.py): gloo (`gloo`, `wire`,
`shm`), LoRA adapters over gloo (`adapter`), vLLM's NCCL engines (`nccl`, `watchdog`, `sparse_nccl`)."""
