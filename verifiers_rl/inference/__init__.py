"""Stage 4, inference: the servers themselves. `server` is `vf-vllm`, which starts real vLLM (`vllm/`, imported only
there) or the built-in CPU engine (`cpu/`); both speak the same HTTP routes and weight-transfer protocol. Everything
that exists for a CPU host (threads, OpenMP, core hand-off) lives under `cpu/`."""
