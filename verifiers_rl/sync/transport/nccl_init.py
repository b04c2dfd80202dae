"""The NCCL weight-transfer init with every stage bounded, and named when it fails.

vLLM's `trainer_init` sends the server's init request on a side thread, opens the trainer's endpoint (a TCP store
rendezvous, then `ncclCommInitRank`, which waits for every rank) and only then reads the request's answer: a worker
that fails after it reached the store leaves the trainer in `ncclCommInitRank` forever, while the error that says
why is already in the answer. Here the same three stages run in turn, each on a daemon thread the caller watches:
the request's failure ends whichever stage is waiting, at once, with the server's error; a stage that outlasts its
bound ends the init with its name. A thread left in `ncclCommInitRank` cannot be cancelled: it stays behind as a
daemon, and the error stops the run. vLLM is imported lazily.
"""

from __future__ import annotations

import math
import time

import torch

from verifiers_rl.errors import ServerError
from verifiers_rl.sync.transport.watchdog import POLL_S, Background

STORE, COMMUNICATOR, REQUEST = "store rendezvous", "communicator creation", "server's init request"


class BoundedInit:
    def __init__(self, control, timeout_s: float):
        self.control = control  # SyncControl: the server's /init_weight_transfer_engine
        self.timeout_s = timeout_s  # each stage's bound

    def open(self, info):
        """vLLM's trainer_init for the sender (NCCL rank 0; the server's workers take ranks 1..n): returns the
        communicator, after the server confirmed its workers' side."""
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        # the dense engine's wire params (the sparse engine's info has none: the workers keep their defaults)
        wire = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
        workers = NCCLWeightTransferInitInfo(
            master_address=info.master_address,
            master_port=info.master_port,
            rank_offset=1,
            world_size=info.world_size,
            **{k: getattr(info, k) for k in wire if hasattr(info, k)},
        )
        payload = worker_init_payload(workers)
        request = Background(lambda: self.control.init_weight_transfer_engine(payload), "nccl-init-request")
        store = Background(lambda: self._rendezvous(info), "nccl-init-store")
        where = f"no worker of the server connected to the trainer's store at {info.master_address}:{info.master_port}"
        group = self._wait(STORE, store, request, where)
        device = torch.accelerator.current_device_index()  # here: a new thread's current CUDA device is 0
        comm = Background(lambda: _communicator(group, device), "nccl-init-communicator")
        hint = "the server's workers reached the store but did not join the NCCL communicator: see the server's log"
        communicator = self._wait(COMMUNICATOR, comm, request, hint)
        if getattr(communicator, "disabled", False):
            # vLLM's communicator turns itself into a no-op when it cannot load libnccl: every sync would "succeed"
            # and move nothing. Said before waiting for the server, whose workers wait for this rank in vain.
            raise RuntimeError("vLLM could not load the NCCL library in the trainer process; use the gloo backend")
        self._wait(REQUEST, request, None, "the communicator is up, the server did not confirm its workers' side")
        return communicator

    def _rendezvous(self, info):
        from vllm.distributed.utils import StatelessProcessGroup

        # the store gives up on its own after the same bound: an abandoned wait does not hold the port for long
        return StatelessProcessGroup.create(
            host=info.master_address,
            port=info.master_port,
            rank=0,
            world_size=info.world_size,
            store_timeout=math.ceil(self.timeout_s),
        )

    def _wait(self, stage: str, work: Background, request: Background | None, hint: str):
        deadline = time.monotonic() + self.timeout_s
        while not work.done.wait(POLL_S):
            if request is not None and request.failed:  # the workers gave up: nothing will join this stage
                raise ServerError(
                    f"NCCL weight-transfer init: the server's init request failed while the trainer waited for the "
                    f"{stage}: {type(request.error).__name__}: {request.error}"
                )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"NCCL weight-transfer init: the {stage} did not finish within {self.timeout_s:g}s ({hint})"
                )
        if work.error is not None:
            cause = work.error
            if request is not None and request.failed:  # the server's answer says more than a broken store
                cause = request.error
            raise ServerError(
                f"NCCL weight-transfer init failed during the {stage}: {type(cause).__name__}: {cause}"
            ) from cause
        return work.value


def _communicator(group, device: int):
    """vLLM's stateless_init_process_group after its store: the communicator on the trainer's CUDA device."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.utils.nccl import unpinned_nccl_env

    with unpinned_nccl_env():
        return PyNcclCommunicator(group, device=device)
