"""The trainer's side of inference: spawn or connect to the server, sync weights, run the orchestrator, evaluate."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import torch

from verifiers_rl.rl.inference.client import ServerError, VLLMClient
from verifiers_rl.rl.inference.control_auth import TOKEN_ENV, read_token_file
from verifiers_rl.rl.inference.discovery import probe_server
from verifiers_rl.rl.inference.launcher import InferenceServer
from verifiers_rl.rl.inference.layout import (
    ADAPTER_NAME,
    LORA_EXTENSION,
    engine_of_models,
    has_flag,
    resolve_engine,
    resolve_sync_backend,
)
from verifiers_rl.rl.inference.transfer.adapter import adapter_serving
from verifiers_rl.rl.inference.transfer.gloo import store_host_for
from verifiers_rl.rl.inference.transfer.policy_weights import adapter_weights, merged_weights
from verifiers_rl.rl.shared_gpu import ModelShape, plan_shared_gpu
from verifiers_rl.rl.trainer.config import DEFAULT_SERVER_PORT
from verifiers_rl.rl.trainer.metrics import rollout_metrics
from verifiers_rl.rl.trainer.orchestrator import GenerationError, Orchestrator, RolloutBatch
from verifiers_rl.rl.trainer.policy_version import PolicyVersion
from verifiers_rl.rl.trainer.prompts import filter_prompts
from verifiers_rl.rl.trainer.rollouts import Rollout

logger = logging.getLogger(__name__)


def cpu_thread_split(args, cores: int | None = None) -> tuple[int, int] | None:
    """(server threads, trainer threads) when the CPU engine and an overlapping trainer share this machine's cores.

    With max_async_level >= 1 generation and training run at the same time; each process defaulting to every
    core oversubscribes them (measured on 2 cores: 1.17 s/step at 2+2 threads vs 0.68 s at 1+1, benchmarks/
    bench_async.py). None when they do not share cores or do not overlap (each phase then gets every core), or
    when OMP_NUM_THREADS is set (the user's choice wins).
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = cores or os.cpu_count() or 1
    local = args.vllm_server_host in ("127.0.0.1", "localhost", "::1")
    engine = resolve_engine(args.server_engine)
    if cores < 2 or args.max_async_level < 1 or engine == "vllm" or not local or torch.cuda.is_available():
        return None
    server = cores // 2
    return server, cores - server


def shares_gpu(args, mode: str) -> bool:
    """Would a vLLM server and this trainer use the same GPU? (Then NCCL cannot sync them: gloo via host memory.)"""
    if not torch.cuda.is_available() or resolve_engine(args.server_engine) != "vllm":
        return False
    if mode == "spawn":
        return args.server_gpus is None or torch.cuda.current_device() in args.server_gpus
    local = args.vllm_server_host in ("127.0.0.1", "localhost", "::1", "0.0.0.0")
    return local and torch.cuda.device_count() == 1


def server_thread_env(split: tuple[int, int] | None) -> dict[str, str] | None:
    """The inference server's share of a `cpu_thread_split`, as environment for its process."""
    return {"OMP_NUM_THREADS": str(split[0])} if split else None


class InferenceRuntime:
    """What the trainer's rank 0 holds: the server (spawned or connected), its client and weight sender, the
    orchestrator, and the policy version the server serves."""

    def __init__(self, args, model_path: str | None, env):
        self.args, self.model_path, self.env = args, model_path, env
        self.server: InferenceServer | None = None  # spawned here: owned, stopped by close()
        self.watched: InferenceServer | None = None  # started by the caller (vf-rl): only watched for failures
        self.client: VLLMClient | None = None
        self.orchestrator: Orchestrator | None = None
        self.model_name: str | None = None
        self.engine: str | None = None  # what the server runs: "cpu" | "vllm"
        self.lora_sync = "merged"  # args.lora_sync with "auto" resolved once the layout is known
        # the trainer's weights are still the ones its model path holds (set by RLTrainer; no step, no resume)
        self.pristine = False
        self.server_has_trainer_weights = False  # a server spawned from exactly the trainer's current weights
        self.max_model_len: int | None = None  # the server's context limit, as it reports it
        self.policy = PolicyVersion()
        self.synced_version: int | None = None
        self.last_rollouts: list[Rollout] = []
        self._threads_before: int | None = None

    # ------------------------------------------------------------------ server

    def _served_path(self, model, tokenizer) -> str:
        from verifiers_rl.models import resolve_model_path

        if self.model_path:
            try:
                path = resolve_model_path(self.model_path)
                self.server_has_trainer_weights = self.pristine
                return path
            except (FileNotFoundError, NotADirectoryError, ValueError):
                pass
        self.server_has_trainer_weights = True
        # An in-memory model: write its (adapter-free) weights where the server can load them.
        path = os.path.join(self.args.output_dir, "served_base")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.save_pretrained(path, state_dict=dict(merged_weights(model)))
        tokenizer.save_pretrained(path)
        return path

    def ensure_server(self, model, tokenizer) -> VLLMClient:
        if self.client is not None:
            return self.client
        args = self.args
        mode, port = args.server_mode, args.vllm_server_port
        token = args.server_control_token or os.environ.get(TOKEN_ENV) or None
        if mode == "auto":
            mode, port = self._discover(port, token)
        split = cpu_thread_split(args)
        shared = shares_gpu(args, mode)
        self.lora_sync = args.lora_sync
        if self.lora_sync == "auto":  # adapters on a shared GPU (no NCCL there, and far fewer bytes)
            adapter = shared and args.use_lora and not args.lora_modules_to_save
            self.lora_sync = "adapter" if adapter else "merged"
        serving = None
        if mode == "spawn" and self.lora_sync == "adapter":
            # vLLM registers the policy as a LoRA adapter at startup (the CPU engine ignores it)
            serving = adapter_serving(model, os.path.join(args.output_dir, "adapter_step0"))
        if mode == "spawn":
            self.server = InferenceServer(
                self._served_path(model, tokenizer),
                engine=args.server_engine,
                host=args.vllm_server_host,
                port=port,
                output_dir=args.output_dir,
                gpus=args.server_gpus,
                max_model_len=args.server_max_len,
                extra_args=self._server_args(model, shared),
                startup_timeout=args.vllm_server_timeout,
                env=server_thread_env(split),
                adapter=serving,
            )
            self.server.client_kwargs = self._client_timeouts()
            client = self.server.start()
            self.engine = self.server.engine
        else:
            port = port or DEFAULT_SERVER_PORT
            token = token or read_token_file(port)
            client = VLLMClient(
                args.vllm_server_host,
                port,
                control_token=token,
                api_key=args.server_api_key,
                **self._client_timeouts(),
            )
            client.wait_for_health(args.vllm_server_timeout)
        models = client.models()
        if self.engine is None:  # connected: the server says what it runs (before the adapter name asks)
            self.engine = engine_of_models(models)
        self.model_name = models[0]["id"]
        if self.lora_sync == "adapter":
            self.model_name = self._adapter_name(models)
        self.max_model_len = models[0].get("max_model_len") or args.server_max_len
        if self.max_model_len < args.server_max_len:
            logger.warning(
                "the server's context is %d tokens, shorter than the %d the config plans for (max_seq_len / "
                "server_max_model_len): requests longer than that will be rejected",
                self.max_model_len,
                args.server_max_len,
            )
        backend = resolve_sync_backend(args.sync_backend, self.engine, shared_gpu=shared)
        if self.lora_sync == "adapter":
            backend = "adapter"
        sender = client.init_weight_transfer(
            backend, host=store_host_for(args.vllm_server_host), bucket_bytes=args.sync_bucket_mb << 20
        )
        if self.engine == "cpu" and backend == "gloo":
            sender.pauses_itself = True  # our engine folds the sync into one request
        if split and self._threads_before is None:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(split[1])
            logger.info("CPU engine and trainer overlap on %d cores: server %d threads, trainer %d", sum(split), *split)
        self.client = client
        return client

    def _server_args(self, model, shared: bool) -> list[str]:
        """The user's server flags, plus vLLM's share of a GPU the trainer also uses (rl/shared_gpu.py)."""
        args = self.args
        extra = list(args.server_args or [])
        if shared and not has_flag(extra, "gpu-memory-utilization"):
            shape = ModelShape.from_config(getattr(model, "config", model))
            plan = plan_shared_gpu(
                shape,
                torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
                use_lora=args.use_lora,
                lora_rank=args.lora_rank,
                micro_batch_tokens=args.token_budget,
                max_seq_len=args.max_seq_len,
                gradient_checkpointing=bool(args.gradient_checkpointing),
            )
            for line in plan.describe():
                logger.info(line)
            extra += ["--gpu-memory-utilization", f"{plan.gpu_memory_utilization:.2f}"]
        return extra

    def _adapter_name(self, models: list[dict]) -> str:
        """Adapter sync: rollouts name the served adapter. Our CPU engine serves any name; vLLM must list it."""
        if self.engine == "cpu" or any(m.get("id") == ADAPTER_NAME for m in models):
            return ADAPTER_NAME
        raise ServerError(
            f"lora_sync='adapter' needs the server to serve the policy as the LoRA adapter {ADAPTER_NAME!r}, but it "
            f"lists {[m.get('id') for m in models]}: start vf-vllm with --enable-lora --lora-modules "
            f"{ADAPTER_NAME}=<adapter dir> --worker-extension-cls {LORA_EXTENSION} --weight-transfer-backend gloo, "
            "or let the trainer spawn it (server_mode='spawn')"
        )

    def _client_timeouts(self) -> dict:
        # a control request answers in milliseconds unless the server is stuck; a sync may move gigabytes
        return {"request_timeout": 30.0, "sync_timeout": self.args.generation_timeout}

    def server_failure(self, what: str) -> ServerError:
        """A ServerError that says what failed, whether the server process is dead or stopped, and where its
        log is (spawned servers); for a server we only connected to, where it is."""
        process = self.server or self.watched
        if process is not None:
            return ServerError(process.describe_failure(what))
        url = self.client.base_url if self.client is not None else "the inference server"
        alive = self.client is not None and self.client.health(timeout=5)
        state = "it answers /health" if alive else "it does not answer /health"
        return ServerError(f"{what}; server {url} ({state})")

    def check_server(self) -> None:
        """Raise at once when a spawned server died or is stopped, instead of failing rollout by rollout."""
        process = self.server or self.watched
        if process is not None and process.status():
            raise self.server_failure("the inference server is gone")

    def _discover(self, port: int | None, token: str | None) -> tuple[str, int | None]:
        """server_mode="auto": connect to the RL server that answers at host:port (8000 when unset), else spawn.

        Something else listening on a port the user named is an error: spawning elsewhere would hide that the
        user's server is not the one being trained."""
        host = self.args.vllm_server_host
        where = port or DEFAULT_SERVER_PORT
        probe = probe_server(
            host, where, api_key=self.args.server_api_key, control_token=token or read_token_file(where)
        )
        if probe.state == "server":
            note = ""
            if self.model_path and Path(str(probe.model)).name != Path(self.model_path).name:
                note = f"; it serves {probe.model!r}, the trainer's model is {self.model_path!r}"
            print(
                f"verifiers-rl: using the {probe.engine} inference server already running at {probe.detail} "
                f"(server_mode='auto'; set server_mode='spawn' to start a dedicated one){note}",
                file=sys.stderr,
                flush=True,
            )
            return "connect", where
        if probe.state == "foreign" and port is not None:
            raise ServerError(
                f"vllm_server_port={port}: {probe.detail}; with server_mode='auto' the trainer trains against the "
                "server at that port: stop what listens there, or set server_mode='spawn' and another port"
            )
        return "spawn", port

    # ------------------------------------------------------------------ training

    def start(self, model, tokenizer, rows, orchestrator_state: dict | None = None) -> None:
        client = self.ensure_server(model, tokenizer)
        if self.orchestrator is None:
            args = self.args
            self.orchestrator = Orchestrator(
                self.env,
                rows,
                base_url=client.base_url + "/v1",
                model_name=self.model_name,
                sampling_args=args.sampling_args,
                rollouts_per_example=args.rollouts_per_example,
                prompts_per_batch=args.prompts_per_batch,
                max_concurrent=args.max_concurrent,
                generation_timeout=args.generation_timeout,
                seed=args.seed,
                shuffle=args.shuffle_dataset,
                api_key=args.server_api_key or "EMPTY",
                policy_version=self.policy,
                max_async_level=args.max_async_level,
            )
        if orchestrator_state:
            self.orchestrator.load_state_dict(orchestrator_state)
        self.orchestrator.start()

    def submit_ahead(self, global_step: int) -> None:
        for b in range(global_step, global_step + self.args.max_async_level + 1):
            self.orchestrator.submit(b)

    @contextlib.contextmanager
    def _waiting_on_rollouts(self):
        """Rollouts that fail or time out while the server died or froze are reported as the server's failure."""
        try:
            yield
        except GenerationError as e:
            self.check_server()
            if e.timed_out:
                raise self.server_failure(str(e)) from None
            raise

    def next_batch(self, global_step: int) -> RolloutBatch:
        with self._waiting_on_rollouts():
            batch = self.orchestrator.get(global_step)
        if any(r.error_kind == "errored" for r in batch.rollouts):
            self.check_server()  # a dead server fails every request: say so now, not after max_empty_steps
        self.last_rollouts = batch.rollouts[: max(self.args.num_completions_to_log, 1)]
        return batch

    def rollout_state(self, timeout: float | None = None) -> dict:
        """The orchestrator's state for a checkpoint (it waits for batches in flight)."""
        with self._waiting_on_rollouts():
            return self.orchestrator.state_dict(timeout=timeout)

    def sync(self, model, version: int) -> float:
        if self.orchestrator is not None:
            self.orchestrator.wait_for_batches_before(version)
        tensors = adapter_weights(model) if self.lora_sync == "adapter" else merged_weights(model)
        try:
            stats = self.client.update_weights(tensors, version=version)
        except Exception as e:  # noqa: BLE001 - httpx, gloo and server errors all end here, as one line
            self.check_server()
            raise self.server_failure(f"weight sync to version {version} failed: {type(e).__name__}: {e}") from None
        self.synced_version = version
        self.policy.advance(version)
        return stats.seconds

    def mark_synced(self, version: int) -> float:
        """The server already holds the weights of `version` (it was started from them, or the step changed
        nothing): advance the version without moving a byte."""
        if self.synced_version is not None and self.synced_version != version:
            self.client.post("/update_weight_version", {"new_version": str(version)})
        self.synced_version = version
        self.policy.advance(version)
        return 0.0

    def kill_server(self) -> None:
        """A second signal: take the spawned server down now, without waiting for it."""
        if self.server is not None:
            self.server.kill()

    def stop_rollouts(self) -> None:
        if self.orchestrator is not None:
            self.orchestrator.close()
            self.orchestrator = None

    def close(self) -> None:
        self.stop_rollouts()
        if self.server is not None:
            self.server.stop()
        elif self.client is not None:
            watched_ok = self.watched is None or self.watched.status() is None
            self.client.close(polite=watched_ok)  # no goodbye requests to a dead or stopped server
        self.server = self.client = None
        self.engine = None
        self.synced_version = None  # a next server starts from the model files, not from these weights
        self.server_has_trainer_weights = False
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    # ------------------------------------------------------------------ eval

    def evaluate(self, model, tokenizer, prefix: str = "eval", global_step: int = 0) -> dict[str, float]:
        args = self.args
        self.ensure_server(model, tokenizer)
        if self.synced_version is None and self.server_has_trainer_weights and global_step == 0:
            self.mark_synced(0)
        elif self.synced_version != global_step:
            self.sync(model, global_step)
        rows = self.env.get_eval_dataset(n=args.num_eval_examples or -1)
        rows, _ = filter_prompts(rows, tokenizer, args.prompt_limit, self.env)
        orch = self.orchestrator or Orchestrator(
            self.env,
            rows,
            base_url=self.client.base_url + "/v1",
            model_name=self.model_name,
            sampling_args=args.sampling_args,
            rollouts_per_example=args.eval_rollouts_per_example,
            prompts_per_batch=1,
            generation_timeout=args.generation_timeout,
            seed=args.seed,
            api_key=args.server_api_key or "EMPTY",
            policy_version=self.policy,
        )
        try:
            rollouts = orch.evaluate(rows, args.eval_rollouts_per_example, args.sampling_args)
        finally:
            if orch is not self.orchestrator:
                orch.close()
        return rollout_metrics(rollouts, prefix)
