"""Getting a server: the trainer's rank 0 spawns one (and owns it) or connects to one, by the serving plan.

`open()` resolves the server mode (a server already answering where the trainer looks, or a new one), makes the
plan (`verifiers_rl.plan.serving`), starts or reaches the server, and joins its weight-transfer group. What
to send and when is `PolicySync`'s business; rollouts are the orchestrator's.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from verifiers_rl.config.choices import Engine, LoraSync, ServerMode
from verifiers_rl.config.net import DEFAULT_PORT, is_local, store_host_for
from verifiers_rl.errors import ServerError
from verifiers_rl.plan.devices import gpu_uuids
from verifiers_rl.plan.layout import ADAPTER_NAME, DEVICE_RPC, LORA_EXTENSION, engine_of_models
from verifiers_rl.plan.memory import ModelShape
from verifiers_rl.plan.run import PLAN_ENV, from_ranks_env, plan_run, probe_machine
from verifiers_rl.plan.serving import (
    ReportedGpus,
    ServingPlan,
    connected_server_uuids,
    placement_problem,
    plan_serving,
    resolve_mode,
)
from verifiers_rl.serving import identity
from verifiers_rl.serving.auth import TOKEN_ENV, read_token_file
from verifiers_rl.serving.client import InferenceClient
from verifiers_rl.serving.discovery import probe_server
from verifiers_rl.serving.launcher import InferenceServer, server_of
from verifiers_rl.sync.policy_weights import merged_weights
from verifiers_rl.sync.transport.adapter import adapter_serving

logger = logging.getLogger(__name__)


class ServerSession:
    def __init__(self, args, model_path: str | None):
        self.args, self.model_path = args, model_path
        # vf-rl planned the server it started: in its process it hands the plan over, to its trainer processes
        # through the environment
        self.plan: ServingPlan | None = from_ranks_env()[0]
        self.process: InferenceServer | None = None  # spawned here: owned, stopped by close()
        self.watched: InferenceServer | None = None  # started by the caller (vf-rl): only watched for failures
        self.client: InferenceClient | None = None
        self.model_name: str | None = None
        self.max_model_len: int | None = None  # the server's context limit, as it reports it
        self.started_from: int | None = None  # the version of the trainer's weights the server was started from
        self.trainer_config = None  # the trainer's model config, checked against a server it connects to

    @property
    def engine(self) -> str | None:
        return self.plan.engine if self.plan is not None and self.client is not None else None

    def open(self, model, tokenizer, version: int, from_files: bool) -> InferenceClient:
        """A healthy server with a weight sender. `version`: the trainer's current policy version; `from_files`:
        the trainer's weights are still its model path's (so a server started from that path holds them)."""
        if self.client is not None:
            return self.client
        args = self.args
        token = args.server_control_token or os.environ.get(TOKEN_ENV) or None
        port = args.vllm_server_port
        mode = "connect" if self.plan is not None else resolve_mode(args.server_mode, lambda: self._discover(token))
        if mode == ServerMode.SPAWN:
            client = self._spawn(model, tokenizer, version, from_files)
        else:
            port = port or DEFAULT_PORT
            client = InferenceClient(
                args.vllm_server_host,
                port,
                control_token=token or read_token_file(port),
                api_key=args.server_api_key,
                **self.client_timeouts(),
            )
            client.wait_for_health(args.vllm_server_timeout)
        models = client.models()
        if self.plan is None:  # connected: the server says what it runs
            self.plan = self._connected_plan(engine_of_models(models), client, getattr(model, "config", None))
        self._check_placement()
        self._read_models(models)
        if mode != ServerMode.SPAWN:
            self.trainer_config = getattr(model, "config", None)
            self._check_served(client, models[0]["id"])
        return self._set_up_sync(client)

    def _check_served(self, client: InferenceClient, served_name: str) -> None:
        """A server the trainer did not start serves the trainer's model, with the backend it sends over
        (serving/identity.py): otherwise one line, before a byte of the trainer's weights reaches it."""
        args = self.args
        fatal, names = identity.differences(
            identity.served_model(client),
            self.trainer_config,
            transport=self.plan.sync_backend,
            changed_only=self.plan.changed_only,
            served_name=served_name,
            model_path=self.model_path,
        )
        explicit = args.server_mode == ServerMode.CONNECT  # the user named this server: its name may differ
        problems = fatal + ([] if explicit else names)
        where = client.base_url
        if problems:
            raise ServerError(
                f"the server at {where} is not one this trainer can sync into: {'; '.join(problems)}. Point the "
                "trainer at its own server (vllm_server_port / [inference] port), or let it start one "
                "(server_mode='spawn')" + ("" if fatal else "; server_mode='connect' trains into this one anyway")
            )
        for note in names:
            logger.warning("the server at %s: %s (server_mode='connect': training into it as asked)", where, note)

    def _check_placement(self) -> None:
        if not torch.cuda.is_available():
            return
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        problem = placement_problem(self.plan, uuid)
        if problem:
            raise ServerError(problem)

    def _connected_plan(self, engine: str, client: InferenceClient, config=None) -> ServingPlan:
        """How to sync with a server that runs already: by what it says it runs, on the GPUs it reports, for the
        trainer's model (`config`: whether vLLM post-processes its weights)."""
        args, cuda = self.args, torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
        mine = gpu_uuids([torch.cuda.current_device()]) if cuda else ()
        reported = reported_gpus(client) if engine == Engine.VLLM else []
        servers = connected_server_uuids(
            reported, local=is_local(args.vllm_server_host), cuda_count=count, trainer_uuids=mine or ()
        )
        unseen = reported.unseen if isinstance(reported, ReportedGpus) else 0  # another engine's GPUs, maybe ours
        return plan_serving(
            args,
            mode="connect",
            engine=engine,
            cuda_count=count,
            server_uuids=servers,
            trainer_uuids=mine or (),
            server_unseen=unseen,
            post_processed=ModelShape.from_config(config).post_processed if config is not None else None,
        )

    def _spawn(self, model, tokenizer, version: int, from_files: bool) -> InferenceClient:
        """The run plan's server (`plan.run.plan_run`, as vf-rl's), started from the trainer's current weights."""
        args = self.args
        path, self.started_from = self._served_path(model, tokenizer, version, from_files)
        shape = ModelShape.from_config(getattr(model, "config", model))
        run = plan_run(args, path, probe_machine(), shape=shape, apply=False)
        for line in run.describe():
            logger.info(line)
        self.plan, self.process = run.serving, server_of(run)
        if self.process.spec.adapter is not None:  # vLLM registers the policy's adapter at startup (CPU: ignored)
            adapter_serving(model, self.process.spec.adapter.path)
        self.process.client_kwargs = self.client_timeouts()
        return self.process.start()

    def _served_path(self, model, tokenizer, version: int, from_files: bool) -> tuple[str, int | None]:
        """Where the server loads its weights from, and the trainer version those weights are (None: not one)."""
        from verifiers_rl.model_source import resolve_model_path

        if self.model_path:
            try:
                path = resolve_model_path(self.model_path)
                return path, (version if from_files and version == 0 else None)
            except (FileNotFoundError, NotADirectoryError, ValueError):
                pass
        # An in-memory model: write its current (merged, adapter-free) weights where the server can load them.
        path = os.path.join(self.args.output_dir, "served_base")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.save_pretrained(path, state_dict=dict(merged_weights(model)))
        tokenizer.save_pretrained(path)
        return path, version

    def _read_models(self, models: list[dict]) -> None:
        args = self.args
        self.model_name = models[0]["id"]
        if self.plan.lora_sync == LoraSync.ADAPTER:
            self.model_name = self._adapter_name(models)
        self.max_model_len = models[0].get("max_model_len") or args.server_max_len
        if self.max_model_len < args.server_max_len:
            logger.warning(
                "the server's context is %d tokens, shorter than the %d the config plans for (max_seq_len / "
                "server_max_model_len): prompts that do not fit it are filtered out",
                self.max_model_len,
                args.server_max_len,
            )

    def _adapter_name(self, models: list[dict]) -> str:
        """Adapter sync: rollouts name the served adapter. Our CPU engine serves any name; vLLM must list it."""
        if self.plan.engine == Engine.CPU or any(m.get("id") == ADAPTER_NAME for m in models):
            return ADAPTER_NAME
        raise ServerError(
            f"lora_sync='adapter' needs the server to serve the policy as the LoRA adapter {ADAPTER_NAME!r}, but it "
            f"lists {[m.get('id') for m in models]}: start vf-vllm with --enable-lora --lora-modules "
            f"{ADAPTER_NAME}=<adapter dir> --worker-extension-cls {LORA_EXTENSION} --weight-transfer-backend gloo, "
            "or let the trainer spawn it (server_mode='spawn')"
        )

    def client_timeouts(self) -> dict:
        # a control request answers in milliseconds unless the server is stuck; a sync may move gigabytes
        return {"request_timeout": 30.0, "sync_timeout": self.args.generation_timeout}

    def _discover(self, token: str | None) -> str:
        """server_mode="auto": connect to the RL server that answers at host:port (8000 when unset), else spawn.

        Something else listening on a port the user named is an error: spawning elsewhere would hide that the
        user's server is not the one being trained."""
        args = self.args
        where = args.vllm_server_port or DEFAULT_PORT
        probe = probe_server(
            args.vllm_server_host, where, api_key=args.server_api_key, control_token=token or read_token_file(where)
        )
        if probe.state == "server":  # what it serves is checked once it is connected (_check_served)
            print(
                f"verifiers-rl: using the {probe.engine} inference server already running at {probe.detail} "
                f"(server_mode='auto'; set server_mode='spawn' to start a dedicated one)",
                file=sys.stderr,
                flush=True,
            )
            return "connect"
        if probe.state == "foreign" and args.vllm_server_port is not None:
            port = args.vllm_server_port
            raise ServerError(
                f"vllm_server_port={port}: {probe.detail}; with server_mode='auto' the trainer trains against the "
                "server at that port: stop what listens there, or set server_mode='spawn' and another port"
            )
        return "spawn"

    # ------------------------------------------------------------------ failures and shutdown

    def failure(self, what: str) -> ServerError:
        """A ServerError that says what failed, whether the server process is dead or stopped, and where its
        log is (spawned servers); for a server we only connected to, where it is."""
        process = self.process or self.watched
        if process is not None:
            return ServerError(process.describe_failure(what))
        url = self.client.base_url if self.client is not None else "the inference server"
        alive = self.client is not None and self.client.health(timeout=5)
        state = "it answers /health" if alive else "it does not answer /health"
        return ServerError(f"{what}; server {url} ({state})")

    def down(self, settle: float = 0.0) -> str | None:
        """Why the server cannot serve and must be replaced: its process died, or (a server we only connected to)
        it does not answer /health. None when it serves. A stopped process raises: it is frozen, not gone, and a
        second server beside it would not help. `settle`: seconds to let a process that is dying finish (its
        sockets close before it exits, so a request can fail a moment before the process is gone)."""
        process = self.process or self.watched
        if process is not None:
            if settle and process.status() is None:
                process.wait_exit(settle)
            status = process.status()
            if status and "is stopped" in status:
                raise self.failure(status)
            return status
        if self.client is not None and not self.client.health(timeout=5):
            return f"the inference server at {self.client.base_url} does not answer /health"
        return None

    def location(self) -> tuple[str, str]:
        """(where the server is and its log, the log's last lines) for a message about it."""
        process = self.process or self.watched
        if process is not None:
            return process.location(), process.tail()
        port = self.args.vllm_server_port or DEFAULT_PORT
        return f"server http://{self.args.vllm_server_host}:{port}", ""

    @property
    def restartable(self) -> bool:
        """The server's process is ours to start again (spawned here, or by vf-rl in this process)."""
        return (self.process or self.watched) is not None

    def replace(self, grace: float) -> InferenceClient:
        """A server again where the lost one was, with a new client and weight-transfer group: ours restarted
        (same port and token), one we only connected to awaited for `grace` seconds. The new server holds what
        the old one was started from (`started_from` stays)."""
        old, self.client = self.client, None
        if old is not None:
            old.close(polite=False)
        process, args = self.process or self.watched, self.args
        if self.process is not None:
            client = self.process.restart()
        else:
            port = args.vllm_server_port or DEFAULT_PORT
            if process is not None:
                process.restart()
            else:
                probe = InferenceClient(args.vllm_server_host, port)
                try:
                    probe.wait_for_health(grace)
                finally:
                    probe.close(polite=False)
            # read once it is up: a server someone restarts by hand writes a new token for its port when it starts
            token = args.server_control_token or os.environ.get(TOKEN_ENV) or read_token_file(port)
            client = InferenceClient(
                args.vllm_server_host, port, control_token=token, api_key=args.server_api_key, **self.client_timeouts()
            )
        models = client.models()
        self._read_models(models)
        if process is None:  # restarted by someone else: it may serve something else now
            self._check_served(client, models[0]["id"])
        return self._set_up_sync(client)

    def _set_up_sync(self, client: InferenceClient) -> InferenceClient:
        """The weight-transfer group with the server, by the plan; the session keeps the client."""
        args = self.args
        client.init_weight_transfer(
            self.plan.sync_backend,
            host=store_host_for(args.vllm_server_host),
            bucket_bytes=args.sync_bucket_mb << 20,
            server_pauses=self.plan.server_pauses,
            shared_memory=args.sync_shared_memory,
            changed_only=self.plan.changed_only,
        )
        self.client = client
        return client

    def check(self) -> None:
        """Raise at once when a spawned server died or is stopped, instead of failing rollout by rollout."""
        process = self.process or self.watched
        if process is not None and process.status():
            raise self.failure("the inference server is gone")

    def kill(self) -> None:
        """A second signal: take the spawned server down now, without waiting for it."""
        if self.process is not None:
            self.process.kill()

    def close(self) -> None:
        if self.process is not None:
            self.process.stop()
        elif self.client is not None:
            watched_ok = self.watched is None or self.watched.status() is None
            self.client.close(polite=watched_ok)  # no goodbye requests to a dead or stopped server
        self.process = self.client = None
        self.started_from = None
        if self.watched is None and PLAN_ENV not in os.environ:
            self.plan = None  # a next server (spawned or found) is planned again


def reported_gpus(client) -> ReportedGpus | None:
    """The GPU UUIDs of a vLLM server's workers, from `vf_device_uuids`, and how many workers did not answer; None
    when the server does not say (vLLM started without our extension, or an error), so the trainer plans without
    knowing them. vLLM answers a collective RPC from its first data-parallel engine only (its core client keeps the
    first engine's result), so with data parallel > 1 the other engines' GPUs are unseen: /get_world_size, which
    counts every worker of every engine, says how many."""
    try:
        results = client.post("/collective_rpc", {"method": DEVICE_RPC}).get("results")
        world = client.get_world_size()
    except Exception:  # noqa: BLE001 - any failure means "not known"
        return None
    if not isinstance(results, list) or not all(isinstance(r, str) for r in results):
        return None
    return ReportedGpus(tuple(r for r in results if r), unseen=max(0, world - len(results)))
