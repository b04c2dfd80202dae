"""The trainer's side of inference, on rank 0: a server (`ServerSession`), the policy it serves (`PolicySync`),
the rollouts generated against it (`Orchestrator`), and evaluation."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from verifiers_rl.config.limits import room_for_prompt
from verifiers_rl.errors import ServerError, ServerLost
from verifiers_rl.inference.cpu.openmp import TrainerThreads
from verifiers_rl.rollouts.difficulty_filter import DifficultyFilter
from verifiers_rl.rollouts.env_mix import eval_rows
from verifiers_rl.rollouts.metrics import rollout_metrics
from verifiers_rl.rollouts.orchestrator import GenerationError, Orchestrator, RolloutBatch
from verifiers_rl.rollouts.process import RolloutProcess, start_rollout_process
from verifiers_rl.rollouts.prompts import filter_prompts, template_kwargs
from verifiers_rl.rollouts.rollouts import Rollout
from verifiers_rl.serving.recovery import ServerRecovery
from verifiers_rl.serving.session import ServerSession
from verifiers_rl.sync.export import WeightExport
from verifiers_rl.sync.policy_sync import PolicySync

logger = logging.getLogger(__name__)


class InferenceRuntime:
    """What the trainer's rank 0 holds: the server (spawned or connected), the policy sync, the orchestrator."""

    def __init__(self, args, model_path: str | None, env):
        self.args, self.env = args, env
        self.session = ServerSession(args, model_path)
        self.policy = PolicySync()
        self.policy.before_transfer = self._before_transfer
        self.policy.on_failure = self._sync_failure
        self.orchestrator: Orchestrator | None = None
        self.from_files = False  # the trainer's weights are still its model path's (RLTrainer sets it)
        self.last_rollouts: list[Rollout] = []
        self.prompts_filtered = 0  # by the server's own context (fitting_rows), besides the config's preflight
        self.recovery = ServerRecovery(self)
        # the trainer's current weights and version, for a replaced server (RLTrainer sets it)
        self.current: Callable[[], tuple[WeightExport, int]] | None = None
        self.cpu_threads = TrainerThreads()
        self._held: RolloutBatch | None = None  # num_iterations > 1: the batch its later steps train again

    # ------------------------------------------------------------------ the server

    @property
    def plan(self):
        return self.session.plan

    @property
    def client(self):
        return self.session.client

    @property
    def max_model_len(self) -> int | None:
        return self.session.max_model_len

    def ensure_server(self, model, tokenizer, version: int = 0):
        if self.session.client is not None:
            return self.session.client
        client = self.session.open(model, tokenizer, version, self.from_files)
        self.policy.attach(client, self.session.plan.weights, self.session.started_from)
        self.policy.bucket_bytes = self.args.sync_bucket_mb << 20
        self.cpu_threads.take(self.session.plan.threads)
        return client

    def check_server(self) -> None:
        self.session.check()

    def server_failure(self, what: str) -> ServerError:
        return self.session.failure(what)

    def _sync_failure(self, what: str) -> ServerError:
        self.session.check()  # a dead or stopped server is the cause: say that
        return self.session.failure(what)

    def kill_server(self) -> None:
        self.session.kill()

    # ------------------------------------------------------------------ the policy

    def sync(self, export: WeightExport, version: int, changed: bool = True) -> float:
        return self._recovering(lambda: self.policy.sync(export, version, changed))

    def _recovering(self, attempt):
        """`attempt()`, and once more after the server was replaced when it failed because the server died."""
        while True:
            try:
                return attempt()
            except ServerError as e:
                cause = None if isinstance(e, ServerLost) else self.recovery.lost()
                if cause is None:
                    raise
                self._replace(cause)

    def _replace(self, cause: str) -> None:
        """Replace the server; a replacement that dies on its first sync counts as the next restart."""
        while True:
            try:
                self.recovery.replace(cause)
                return
            except ServerLost:
                raise
            except ServerError:
                cause = self.recovery.lost()
                if cause is None:
                    raise

    def _before_transfer(self, version: int) -> None:
        if self.orchestrator is not None:  # no sync lands inside a batch that needs an older policy
            self.orchestrator.wait_for_batches_before(version)

    # ------------------------------------------------------------------ rollouts

    def _orchestrator(
        self,
        rows,
        *,
        rollouts_per_example: int,
        prompts_per_batch: int,
        max_async_level: int = 0,
        steps_per_batch: int = 1,
        process: RolloutProcess | None = None,
        difficulty_filter: DifficultyFilter | None = None,
    ):
        args = self.args
        return Orchestrator(
            self.env,
            rows,
            base_url=self.session.client.base_url + "/v1",
            model_name=self.session.model_name,
            sampling_args=args.sampling_args,
            rollouts_per_example=rollouts_per_example,
            prompts_per_batch=prompts_per_batch,
            max_concurrent=args.max_concurrent,
            generation_timeout=args.generation_timeout,
            seed=args.seed,
            shuffle=args.shuffle_dataset,
            api_key=args.server_api_key or "EMPTY",
            policy_version=self.policy.served,
            max_async_level=max_async_level,
            scoring_timeout=args.scoring_timeout,
            steps_per_batch=steps_per_batch,
            process=process,
            difficulty_filter=difficulty_filter,
        )

    def start(self, model, tokenizer, rows, version: int, orchestrator_state: dict | None = None) -> None:
        # the rollout process imports and loads the environment (seconds) while the server starts
        process = start_rollout_process(self.env) if self.orchestrator is None and self.args.rollout_process else None
        try:
            self.ensure_server(model, tokenizer, version)
            if self.orchestrator is None:
                rows, self.prompts_filtered = self.fitting_rows(rows, tokenizer)
                args = self.args
                self.orchestrator = self._orchestrator(
                    rows,
                    rollouts_per_example=args.rollouts_per_example,
                    prompts_per_batch=args.prompts_per_batch,
                    max_async_level=args.max_async_level,
                    steps_per_batch=args.num_iterations,
                    process=process,
                    difficulty_filter=DifficultyFilter.of(args),
                )
        except BaseException:
            if process is not None:  # not adopted by an orchestrator: nothing else would close it
                process.close()
            raise
        if orchestrator_state:
            self.orchestrator.load_state_dict(orchestrator_state)
        self.orchestrator.start()

    def fitting_rows(self, rows, tokenizer):
        """The preflight once more with the context the server reports, when it is shorter than the config
        planned for (a server started by someone else): the server's rule, so no prompt kept is rejected."""
        limit, args = self.session.max_model_len, self.args
        if limit is None or limit >= args.server_max_len:
            return rows, 0
        most = min(args.prompt_limit, room_for_prompt(limit, args.max_tokens))
        fix = f"start the server with a larger --max-model-len (it has {limit}), or lower max_tokens"
        kwargs = template_kwargs(args.sampling_args)
        return filter_prompts(
            rows, tokenizer, most, self.env, fix=fix, context=(limit, args.max_tokens), chat_template_kwargs=kwargs
        )

    def submit_ahead(self, global_step: int) -> None:
        if self.orchestrator is None:  # stopped: the server was lost after this step
            return
        # the batches first trained within max_async_level steps of this one (batch b at step b * num_iterations)
        per = self.args.num_iterations
        for b in range(global_step // per, (global_step + self.args.max_async_level) // per + 1):
            self.orchestrator.submit(b)

    @contextlib.contextmanager
    def _waiting_on_rollouts(self):
        """Rollouts that fail or time out while the server died or froze are reported as the server's failure."""
        try:
            yield
        except GenerationError as e:
            self.check_server()  # a dead or stopped server is the cause, whatever the stage
            if e.timed_out and e.stage in (None, "generation"):
                raise self.server_failure(str(e)) from None
            raise

    def next_batch(self, global_step: int) -> RolloutBatch:
        """The batch of this step (the same one for num_iterations steps in a row), generated again on a replaced
        server when the server died under it."""
        index = global_step // self.args.num_iterations
        if self._held is not None and self._held.index == index:
            return self._held
        self._held = None
        while True:
            batch = self._recovering(lambda: self._get(index))
            cause = self.recovery.lost(batch)  # a dead server fails every request: replace it now
            if cause is None:
                break
            self._replace(cause)
        self.recovery.served()
        self.last_rollouts = batch.rollouts[: max(self.args.num_completions_to_log, 1)]
        if self.args.num_iterations > 1:
            self._held = batch
        return batch

    def _get(self, index: int) -> RolloutBatch:
        with self._waiting_on_rollouts():
            return self.orchestrator.get(index)

    def rollout_state(self, global_step: int, timeout: float | None = None) -> dict:
        """The orchestrator's state for a checkpoint (it waits for batches in flight). Batches that lost requests
        to a dead server are left out: the step that needs them generates them again, as a resume would."""
        with self._waiting_on_rollouts():
            state = self.orchestrator.state_dict(timeout=timeout)
        ready = state["ready"]
        held = self._held
        if held is not None and held.index == global_step // self.args.num_iterations:
            # the batch that steps after `global_step` train again: a resume trains it, as the run would have
            ready = state["ready"] = {**ready, held.index: held}
        if any(r.error_kind == "errored" for b in ready.values() for r in b.rollouts) and self.recovery.lost():
            clean = {i: b for i, b in ready.items() if not any(r.error_kind == "errored" for r in b.rollouts)}
            state = {**state, "ready": clean}
        return state

    def stop_rollouts(self) -> None:
        if self.orchestrator is not None:
            self.orchestrator.close()
            self.orchestrator = None

    def close(self) -> None:
        self.stop_rollouts()
        self.session.close()
        self.policy.detach()  # a next server starts from the model files, not from these weights
        self.cpu_threads.give_back()

    # ------------------------------------------------------------------ eval

    def evaluate(self, tokenizer, prefix: str = "eval", temperature: float | None = None) -> dict:
        """Rollouts on the eval split with the policy the server serves (the caller started the server and synced
        it: see `RLTrainer.evaluate`, where every rank takes part in a sharded sync), at `temperature` (None: the
        config's eval_temperature, else its sampling temperature)."""
        args = self.args
        rows = eval_rows(self.env, args.num_eval_examples or -1)  # a mixture: that many of each environment
        kwargs = template_kwargs(args.sampling_args)
        rows, _ = filter_prompts(rows, tokenizer, args.prompt_limit, self.env, chat_template_kwargs=kwargs)
        rows, _ = self.fitting_rows(rows, tokenizer)
        orch = self.orchestrator or self._orchestrator(
            rows, rollouts_per_example=args.eval_rollouts_per_example, prompts_per_batch=1
        )
        sampling = dict(args.sampling_args)
        temperature = args.eval_temperature if temperature is None else temperature
        if temperature is not None:
            sampling["temperature"] = temperature
        try:
            rollouts = orch.evaluate(rows, args.eval_rollouts_per_example, sampling)
        finally:
            if orch is not self.orchestrator:
                orch.close()
        return rollout_metrics(rollouts, prefix)
