"""Weight sync over a gloo group that never touches torch.distributed's default group.

The trainer owns the rendezvous (TCPStore master, rank 0) so a restarted server can always rejoin it, and so the
trainer's own DDP group (if any) stays untouched. Methods are called on the ProcessGroup object itself:
`dist.broadcast(group=pg)` rejects a group that was not created through init_process_group.

One init schema (`GlooInitInfo`) serves every receiver: our CPU engine and our vLLM plugin's workers.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from verifiers_rl.config.net import LOOPBACK, is_loopback
from verifiers_rl.errors import ServerError
from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES, TensorMeta, UpdateInfo, plan_buckets
from verifiers_rl.sync.delta import Changes, Outgoing
from verifiers_rl.sync.sender import NamedTensors, SyncStats
from verifiers_rl.sync.stream import WeightStream, as_stream
from verifiers_rl.sync.transport.shm import SharedSlots
from verifiers_rl.sync.transport.watchdog import Background

# Where the buckets move; imported from here by the receivers, the adapter sender and the benchmarks.
from verifiers_rl.sync.transport.wire import (  # noqa: F401
    WeightGroup,
    broadcast,
    broadcast_async,
    in_place,
    receive_buckets,
    send_buckets,
)
from verifiers_rl.sync.verify import verify

_PREFIX = "verifiers_rl_weights"
# The receivers' reports are in the store by the time the sync's request answers (vLLM answers once every engine
# has loaded); this only bounds the wait for a rank that died before writing its own.
REPORT_WAIT_S = 30.0


@dataclass
class GlooInitInfo:
    """Body of `/init_weight_transfer_engine`'s `init_info`: where the trainer's TCPStore listens."""

    master_address: str
    master_port: int
    # Receivers' ranks start after the trainer's rank 0, as in vLLM's NCCL backend.
    rank_offset: int = 1
    world_size: int = 2
    # Must equal the trainer's bucket size: both sides derive the bucket plan from it.
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0
    # The run's secret: every rendezvous key lives under it, so a peer that does not present it (it only
    # travels in this token-protected request) cannot join or disturb the group.
    group_key: str = ""
    # Shared-memory buckets (shm.py), offered to a receiver on this machine: the file and the nonce it holds.
    shm_path: str = ""
    shm_nonce: str = ""

    def __post_init__(self):
        try:
            ints = (self.master_port, self.rank_offset, self.world_size, self.bucket_bytes)
            self.master_port, self.rank_offset, self.world_size, self.bucket_bytes = map(int, ints)
            self.timeout_s = float(self.timeout_s)
        except (TypeError, ValueError) as e:
            raise ValueError(f"init_info has a non-numeric port, rank, size or timeout: {e}") from None
        if not 0 < self.master_port < 65536:
            raise ValueError(f"init_info.master_port={self.master_port} is not a TCP port")
        if self.bucket_bytes <= 0:
            raise ValueError(f"init_info.bucket_bytes={self.bucket_bytes} must be > 0")
        if not isinstance(self.shm_path, str) or not isinstance(self.shm_nonce, str):
            raise ValueError("init_info.shm_path and init_info.shm_nonce must be strings")
        if self.world_size < 2 or not (0 < self.rank_offset < self.world_size):
            raise ValueError(f"init_info.rank_offset={self.rank_offset} does not fit world_size={self.world_size}")

    @classmethod
    def parse(cls, info: dict) -> GlooInitInfo:
        """From a request body; a missing or unknown key is a ValueError (the server answers 400)."""
        if not isinstance(info, dict):
            raise ValueError(f"init_info must be an object, got {type(info).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(info) - names)
        if unknown:
            raise ValueError(f"init_info has unknown keys {unknown}; allowed: {sorted(names)}")
        try:
            return cls(**info)
        except TypeError as e:
            raise ValueError(f"init_info needs master_address and master_port: {e}") from None


def open_store(host: str, port: int = 0, world_size: int = 2, timeout_s: float = 300.0):
    """The trainer's rendezvous store, listening on `host` only (port 0: a free one, read back from `store.port`).
    TCPStore on its own listens on every interface; handed a socket bound to `host`, a store for a loopback server
    is not reachable from the network at all. The store closes the descriptor it is given: it gets a duplicate, so
    no descriptor is closed twice (a second close would hit whatever reused the number)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        timeout = datetime.timedelta(seconds=timeout_s)
        return dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=os.dup(sock.fileno()),
        )


def join_group(store, rank: int, world_size: int, timeout_s: float = 300.0, group_key: str = "") -> WeightGroup:
    """Blocks until every rank has joined (under the run's secret key)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = f"{_PREFIX}/{group_key}" if group_key else _PREFIX
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, timeout)
    return WeightGroup(pg, store, rank, world_size, group_key)


def connect_group(info: GlooInitInfo, rank: int) -> WeightGroup:
    """Receiver side: connect to the trainer's store and join as `rank`. A store that cannot be reached is a
    ValueError that names the address (the server answers 400, not a 500 traceback)."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    try:
        store = dist.TCPStore(info.master_address, info.master_port, info.world_size, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as e:
        raise ValueError(
            f"cannot reach the trainer's weight-sync store at {info.master_address}:{info.master_port}: {e}"
        ) from None
    return join_group(store, rank, info.world_size, info.timeout_s, info.group_key)


def create_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> WeightGroup:
    """Rank 0 hosts the store at (host, port); other ranks connect to it. Blocks until all ranks joined."""
    if rank == 0:
        return join_group(open_store(host, port, world_size, timeout_s), 0, world_size, timeout_s)
    return connect_group(GlooInitInfo(host, port, rank, world_size, timeout_s=timeout_s), rank)


def _report_key(group: WeightGroup, sync_id: str, rank: int) -> str:
    return f"{_PREFIX}/{group.key}/report/{sync_id}/{rank}"


def publish_report(group: WeightGroup, sync_id: str, result: dict) -> None:
    """Receiver side: leave this rank's answer to sync `sync_id` in the trainer's store. vLLM's /collective_rpc
    answers with the first data-parallel engine's results only; the store reaches the trainer from every rank."""
    group.store.set(_report_key(group, sync_id, group.rank), json.dumps(result))


def collect_reports(group: WeightGroup, sync_id: str, timeout_s: float) -> dict[int, dict]:
    """Trainer side: every receiving rank's answer to `sync_id` (ranks 1..world-1), removed from the store once
    read; a rank that left none within `timeout_s` is a RuntimeError that names it."""
    keys = {rank: _report_key(group, sync_id, rank) for rank in range(1, group.world_size)}
    try:
        group.store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # torch's DistStoreError
        missing = [rank for rank, key in keys.items() if not group.store.check([key])]
        raise RuntimeError(f"inference ranks {missing} left no answer to the update within {timeout_s:.0f}s") from None
    reports = {rank: json.loads(group.store.get(key)) for rank, key in keys.items()}
    for key in keys.values():
        group.store.delete_key(key)
    return reports


class GlooSender:
    """Merged weights: one `/update_weights` request describes the whole sync, the bytes follow in buckets."""

    backend = "gloo"
    # Set for our CPU engine: `/update_weights` with a weight_version pauses, finishes and resumes by itself,
    # so the client skips its pause/resume and the sync is one control round trip instead of six.
    pauses_itself = False
    # With pauses_itself (our CPU engine) and a loopback host: buckets through shared memory where it can (shm.py).
    offers_shared_memory = True

    def __init__(
        self,
        client,
        *,
        host: str = LOOPBACK,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
        changed_only: bool = False,
    ):
        self.client, self.host = client, host
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group: WeightGroup | None = None
        self.changes = Changes() if changed_only else None  # send only what changed (sync/delta.py)

    def post(self, path: str, body: dict | None = None) -> dict:
        """A request of the sync: it may take as long as the sync itself (a server loading a large model answers
        once every worker has), so the sync's deadline applies, not the client's per-request one."""
        return self.client.post(path, body, timeout=self.timeout_s)

    def init(self) -> None:
        world = 1 + self.client.get_world_size()
        store = open_store(self.host, 0, world, self.timeout_s)
        key = secrets.token_hex(16)
        info = GlooInitInfo(self.host, store.port, 1, world, self.bucket_bytes, self.timeout_s, key)
        # our CPU engine, one receiver, on this machine: offer it shared memory (shm.py)
        local = self.pauses_itself and self.offers_shared_memory and world == 2 and is_loopback(self.host)
        offer = SharedSlots.create(self.bucket_bytes) if local else None
        if offer is not None:
            info.shm_path, info.shm_nonce = offer[0].path, offer[1]
        # the server's workers join while this thread waits in the rendezvous
        body = {"init_info": dataclasses.asdict(info)}
        joined = Background(lambda: self.post("/init_weight_transfer_engine", body))
        try:
            self.group = join_group(store, 0, world, self.timeout_s, key)
            answer = joined.result()
        finally:
            if offer is not None:
                offer[0].unlink()  # mapped by both sides now (or declined): the mappings keep the memory
        if offer is not None and isinstance(answer, dict) and answer.get("shm") is True:
            self.group.shm = offer[0]

    @property
    def shared_memory(self) -> bool:
        """Whether buckets travel through shared memory (shm.py) rather than over gloo."""
        return self.group is not None and self.group.shm is not None

    def send(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        if self.group is None:
            raise RuntimeError("call init() before send()")
        t0 = time.perf_counter()
        tensors = as_stream(named_tensors)
        if self.changes is None:
            return self._send(tensors, version, t0)
        with self.changes.sending(tensors, self.client.weight_version, version) as out:
            return self._send(out.wire(), version, t0, out)

    def relabel(self, version: int, was: int | None) -> None:
        """The server serves the weights it held as `was` as `version` now (`InferenceClient.relabel`)."""
        if self.changes is not None:
            self.changes.relabel(version, was)

    def _send(self, tensors: WeightStream, version: int, t0: float, out: Outgoing | None = None) -> SyncStats:
        if self.pauses_itself:  # our CPU engine: the whole sync is one request (vLLM keeps its own routes)
            body = {"weight_version": str(version)}
            sent, buckets = self._move(tensors, version, lambda info: {"update_info": info.to_dict(), **body}, out)
        else:
            self.post("/start_weight_update")
            sent, buckets = self._move(tensors, version, lambda info: {"update_info": info.to_dict()}, out)
            # verified before finish: a sync that did not land never gets its version
            self.post("/finish_weight_update", {"weight_version": str(version)})
            self.client.reset_prefix_cache(timeout=self.timeout_s)
        return SyncStats(time.perf_counter() - t0, sent, len(tensors.metas), buckets, version)

    def _move(
        self,
        tensors: WeightStream,
        version: int,
        body: Callable,
        out: Outgoing | None = None,
        path: str = "/update_weights",
    ) -> tuple[int, int]:
        """Describe the sync (`body(UpdateInfo)`, POSTed to `path` on its own thread), move its buckets, check what
        landed: (bytes sent, buckets). `out`: a sync of changes (sync/delta.py), for which our CPU engine reports
        checksums of the whole tensors it updates (read back); vLLM's workers, whose parameters are fused and
        sharded, report the tensors received (and 0 for those whose changes did not land where they compared
        them)."""
        metas = tensors.metas
        buckets = plan_buckets(metas, self.bucket_bytes)
        report, sums = f"{version}-{secrets.token_hex(6)}", []
        info = UpdateInfo.from_metas(metas, report)
        info.delta = out.header if out is not None else None
        whole = info.delta is not None and self.pauses_itself
        pending = Background(lambda: self.post(path, body(info)))
        sent = send_buckets(self.group, buckets, tensors, None if whole else sums)
        self._answer(pending, report)
        self.verify(report, *((out.targets, out.checksums) if whole else (metas, sums)), version)
        return sent, len(buckets)

    def verify(self, report: str, metas: list[TensorMeta], sent: list[int], version: int) -> None:
        """Every receiving rank's checksums of what it loaded against the trainer's (verify.py). A rank that
        refused the update (the adapter's RPC does, after draining the data, so the group stays usable) reports
        {"error": ...} instead."""
        reports = collect_reports(self.group, report, min(REPORT_WAIT_S, self.timeout_s))
        refused = _refusal(reports)
        if refused:
            raise ServerError(refused)
        verify(version, [m.name for m in metas], [m.nbytes for m in metas], sent, reports)

    def _answer(self, pending: Background, report: str):
        """The update request's answer. vLLM answers a worker's refusal with a bare 500; the worker left its reason
        in the store first, so the error says that instead."""
        try:
            return pending.result()
        except ServerError as e:
            try:
                refused = _refusal(collect_reports(self.group, report, 1.0))
            except RuntimeError:
                refused = None
            if refused:
                raise ServerError(refused) from e
            raise

    def close(self, polite: bool = True) -> None:
        if self.group is not None:
            # dropping the group drops the store (it stops listening when destroyed, closing its descriptor)
            self.group = None
            if not polite:
                return
            try:  # a goodbye, not a need: a short deadline, so a stuck server cannot hold up the exit
                self.client.post("/shutdown_weight_transfer_engine", timeout=5.0)
            except Exception:  # noqa: BLE001 - the server may already be gone
                pass


def _refusal(reports: dict[int, dict]) -> str | None:
    """The line for receivers that refused an update (their report is {"error": ...}), or None."""
    refused = {rank: r["error"] for rank, r in reports.items() if r.get("error")}
    if not refused:
        return None
    rank, reason = next(iter(refused.items()))
    where = f"inference rank {rank}" + (f" and {len(refused) - 1} more" if len(refused) > 1 else "")
    return f"the weight update was refused by the server ({where}): {reason}"
