"""Reliability, round 2: nothing trained is a failure, faults are blamed on the right part, a dead server is
replaced, a requeued job resumes, checkpoints survive kill -9 and a full disk. Run alone with
`pytest -m reliability`.

Everything here is real: `vf-rl` and the CPU engine as processes, kill -9 and SIGTERM, verifiers environments
(tests/rl_envs.py, and verifiers' own PythonEnv for a sandbox environment without its key). The one stand-in is
the full disk: a write hook that raises OSError(ENOSPC) (mounting a small tmpfs is not allowed everywhere CI runs).
Processes are found through the launcher's parent-pid marker, never by name."""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import time

import pytest
from procs import run_command, survivors
from runs import error_line, start, steps, wait_for_step, write_cfg
from waits import wait_healthy, wait_until

pytestmark = pytest.mark.reliability


def _gone(pid: int, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while survivors(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return survivors(pid)


# ---------------------------------------------------------------------------------------------- 1. nothing trained


def test_a_short_run_that_trained_nothing_fails_with_each_steps_cause(tmp_path, tiny_model_dir):
    # 2 steps, max_empty_steps 3: the consecutive-step rule never fires; the end of train() must
    # a request field the CPU engine refuses (HTTP 400): every request of every step is rejected
    cfg = write_cfg(tmp_path, tiny_model_dir, steps=2, extra="sampling_args = {top_logprobs = 2}\n")
    r, pid = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    line = error_line(r.stderr)
    assert "the run trained nothing: none of its 2 steps had a trainable sample (steps 1-2: all 8 requests were " \
           "rejected by the server (first: " in line and "top_logprobs > 0 is not supported" in line, line  # fmt: skip
    assert "vf-rl: done" not in r.stdout
    assert not _gone(pid)


def test_one_configuration_error_in_every_rollout_stops_at_that_step(tmp_path, tiny_model_dir, monkeypatch):
    """Upstream's math-python is verifiers' PythonEnv: without PRIME_API_KEY every sandbox fails to start."""
    from rl_envs import python_env_without_key

    from verifiers_rl.errors import TrainingError
    from verifiers_rl.trainer import RLConfig, RLTrainer

    monkeypatch.delenv("PRIME_API_KEY", raising=False)
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, batch_size=8, rollouts_per_example=4, micro_batch_size=4,
                    max_tokens=4, max_seq_len=1024, max_steps=5, save_strategy="no", log_completions=False,
                    max_async_level=0, server_mode="spawn")  # fmt: skip
    trainer = RLTrainer(model=tiny_model_dir, env=python_env_without_key(), args=args)
    try:
        with pytest.raises(TrainingError) as err:
            trainer.train()
    finally:
        trainer.close()
    message = str(err.value)
    assert message.startswith("step 1: every one of the 8 rollouts failed with the same configuration error"), message
    assert "PRIME_API_KEY" in message
    assert trainer.state.global_step == 0  # stopped at the first step, not after max_empty_steps


# ---------------------------------------------------------------------------------------------- 3. empty dataset


def test_an_empty_dataset_names_the_environment_and_the_argument(tmp_path, tiny_model_dir):
    cfg = write_cfg(tmp_path, tiny_model_dir, replace={"num_train_examples = 32": "num_train_examples = 0"})
    r, pid = run_command("vf-rl", "@", cfg)
    assert r.returncode == 2, r.stderr[-3000:]
    line = error_line(r.stderr)
    assert "environment 'reverse-text' has no training examples with env.args.num_train_examples=0" in line, line
    assert not survivors(pid) and not (tmp_path / "out" / "logs" / "inference.log").exists()  # nothing started


# ---------------------------------------------------------------------------------------------- 5. model paths


@pytest.mark.parametrize(
    "prog, model, message",
    [
        ("vf-rl", "/no/such/model", "model = '/no/such/model': model path '/no/such/model' does not exist"),
        ("vf-rl", "./missing-model", "model = './missing-model': model path './missing-model' does not exist"),
        ("vf-rl", "nobody/no-such-model", "it is not there, and no local directory has that name"),
        ("vf-train", "/no/such/model", "model = '/no/such/model': model path '/no/such/model' does not exist"),
    ],
)
def test_model_path_errors_come_in_under_a_second(tmp_path, prog, model, message):
    write_cfg(tmp_path, model)
    t0 = time.monotonic()
    r, pid = run_command(prog, "@", "cfg.toml", cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-3000:]
    assert message in error_line(r.stderr, prog)
    assert elapsed < 1.0, elapsed


# ---------------------------------------------------------------------------------------------- 2. the context rule


def test_multi_turn_rollouts_that_outgrow_the_context_train_their_turns_that_fit(tmp_path, tiny_model_dir):
    """alphabet-sort at max_seq_len 256: first turns fit (the preflight keeps exactly the prompts the server
    accepts), second turns do not. Those rollouts end as truncated, and their first turns train."""
    import json

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        textwrap.dedent(
            f"""
            model = "{tiny_model_dir}"
            output_dir = "{tmp_path / "out"}"
            [env]
            id = "alphabet-sort"
            [env.args]
            num_train_examples = 16
            num_eval_examples = 4
            min_turns = 2
            max_turns = 2
            [inference]
            engine = "cpu"
            [trainer.args]
            max_steps = 2
            rollouts_per_example = 4
            batch_size = 8
            micro_batch_size = 8
            max_tokens = 48
            max_seq_len = 256
            save_steps = 100
            log_completions = false
            """
        )
    )
    r, pid = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is multi-turn (max_turns=2): each request carries the turns before it" in r.stderr
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "reward" in x]
    assert [x["step"] for x in rows] == [1, 2]
    assert all(x["trained_tokens"] > 0 and x["rollouts_rejected"] == 0 for x in rows), rows
    assert sum(x["rollouts_context_full"] for x in rows) > 0, rows


# ---------------------------------------------------------------------------------------------- 4. blame


STUCK_ENVS = """
import asyncio, time
import verifiers as vf
from datasets import Dataset

def _ds():
    return Dataset.from_list([{"question": f"say {i}", "answer": str(i)} for i in range(8)])

def never_returns(completion, **kw):
    time.sleep(3600)  # a judge call without a timeout: blocks whatever thread runs it

class StuckTool(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kw):
        await asyncio.Event().wait()  # a tool server that never answers

def load_environment(kind: str = "reward"):
    if kind == "reward":
        return vf.SingleTurnEnv(dataset=_ds(), rubric=vf.Rubric(funcs=[never_returns]))
    return StuckTool(dataset=_ds(), rubric=vf.Rubric(funcs=[lambda completion, **kw: 1.0]), max_turns=3)
"""


@pytest.fixture(scope="module")
def stuck_env_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("stuck")
    (root / "stuck_env.py").write_text(STUCK_ENVS)
    return root


@pytest.mark.parametrize(
    "kind, timeouts, message",
    [
        ("reward", "scoring_timeout = 3\ngeneration_timeout = 300\n",
         "reward function never_returns did not return within scoring_timeout=3s (stuck in scoring: reward function "
         "never_returns running for"),
        # the same blame on the orchestrator's thread (an environment that cannot be copied into a rollout process)
        ("reward", "scoring_timeout = 3\ngeneration_timeout = 300\nrollout_process = false\n",
         "reward function never_returns did not return within scoring_timeout=3s (stuck in scoring: reward function "
         "never_returns running for"),
        ("tool", "generation_timeout = 8\n",
         "did not finish within generation_timeout=8s: stuck in env_response: StuckTool.env_response running for"),
    ],
)  # fmt: skip
def test_a_stuck_stage_is_named_and_the_server_is_not_blamed(tmp_path, tiny_model_dir, stuck_env_path, kind,
                                                            timeouts, message):  # fmt: skip
    env_section = {'id = "reverse-text"': 'id = "stuck-env"', "num_train_examples = 32": f'kind = "{kind}"',
                   "num_eval_examples = 4\n": ""}  # fmt: skip
    cfg = write_cfg(tmp_path, tiny_model_dir, steps=3, extra=timeouts, replace=env_section)
    env = {"PYTHONPATH": f"{stuck_env_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.monotonic()
    r, pid = run_command("vf-rl", "@", cfg, env=env, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    line = error_line(r.stderr)
    assert message in line, line
    # the server is cleared in so many words when no request waits on it; requests of other rollouts may still be
    # in flight when a reward function times out (CI, once), and are then listed after it, not blamed
    cleared = "no request is waiting on the inference server: the environment is stuck, not the server" in line
    assert cleared != ("request(s) to the inference server waiting" in line), line
    assert "check the inference server log" not in line and "inference.log" not in line
    assert time.monotonic() - t0 < 120  # the scoring timeout, not generation_timeout=300
    assert not _gone(pid)


# ---------------------------------------------------------------------------------------------- 7. requeue


@pytest.mark.slow  # 62 s; in `pytest -m reliability`. CI keeps the SIGINT save-and-resume of test_faults
def test_requeued_runs_resume_and_say_so_with_one_metrics_row_per_step(tmp_path, tiny_model_dir):
    """What SLURM --requeue or a restarted pod does: SIGTERM, the same command again, several times over."""
    out = tmp_path / "out"
    cfg = write_cfg(tmp_path, tiny_model_dir, steps=5, save_steps=100)  # only the signal saves
    last = 0
    for requeue in range(2):
        proc = start(cfg)
        wait_for_step(proc, out, last + 1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, err[-3000:]
        assert ("verifiers-rl: resuming from" in err) == (requeue > 0), err[-3000:]
        if requeue:
            assert f"verifiers-rl: resuming from {out}/checkpoint-{last} (step {last} of 5)" in err, err[-3000:]
        assert not _gone(proc.pid)
        last = max(steps(out))
        assert (out / f"checkpoint-{last}").is_dir()
    r, pid = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"verifiers-rl: resuming from {out}/checkpoint-{last} (step {last} of 5)" in r.stderr
    assert steps(out) == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------------------------- 8. crash consistency


class _Saver:
    """tests/scripts/checkpoint_saver.py: one trainer set up once, checkpoint-saving children forked and killed."""

    def __init__(self, model: str, out):
        import subprocess
        import sys

        from procs import ROOT

        script = ROOT / "tests" / "scripts" / "checkpoint_saver.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), model, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._reply() == "ready"

    def _reply(self) -> str:
        """The saver's next answer (its lines start with "saver> "; libraries print to stdout too)."""
        for line in self.proc.stdout:
            if line.startswith("saver> "):
                return line[len("saver> ") :].strip()
        raise AssertionError(f"the saver exited ({self.proc.wait()})")

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def kill_and_check(self, command: str, delay: float | None) -> dict:
        import json

        child = int(self.ask(command))
        if delay is not None:
            time.sleep(delay)
            os.kill(child, signal.SIGKILL)
        return json.loads(self.ask("check"))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def test_kill_9_at_random_moments_of_checkpoint_saves_always_leaves_a_resumable_one(tmp_path, tiny_model_dir):
    import random

    saver = _Saver(tiny_model_dir, tmp_path / "o")
    rng = random.Random(0)
    try:
        results = [saver.kill_and_check("save", rng.uniform(0.05, 0.6)) for _ in range(30)]
        # the same step saved again over itself (a resume that skipped a broken newest checkpoint does that), with
        # the kill placed at each file-system operation of the publish in turn
        again = []
        for k in range(1, 6):
            newest = results[-1]["resumable"] if not again else again[-1]["resumable"]
            again.append({**saver.kill_and_check(f"save {k}", None), "k": k, "newest_before": newest})
    finally:
        saver.close()
    for r in results:
        if r["checkpoints"]:  # from the first complete save on, every restart resumes from a complete checkpoint
            assert r["resumable"] and r["loaded"], r
    assert results[-1]["checkpoints"], results[-1]
    assert sum(bool(r["interrupted"]) for r in results) >= 10, results  # most kills landed inside a save
    reached = [int(r["resumable"].split("-")[1]) for r in results if r["resumable"]]
    assert reached == sorted(reached) and reached[-1] >= 10, reached  # progress is kept
    for r in again:  # the step being saved again is never lost, wherever the kill falls
        assert r["resumable"] == r["newest_before"] and r["loaded"], again


# The stand-in for a full disk (a small tmpfs cannot be mounted everywhere CI runs): an audit hook, installed at
# interpreter start, that fails the open of one file with ENOSPC, as a write to a full disk fails.
FULL_DISK = """
import errno, os, sys

_target = os.environ.get("VF_TEST_FULL_DISK")

def _full_disk(event, args):
    if event == "open" and _target and str(args[0]).endswith(_target) and any(c in (args[1] or "") for c in "wax+"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]))

sys.addaudithook(_full_disk)
"""


@pytest.mark.slow  # 40 s; in `pytest -m reliability` (CI time)
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_resumes(tmp_path, tiny_model_dir):
    from verifiers_rl.export.checkpoints import problem

    out = tmp_path / "out"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK)
    cfg = write_cfg(tmp_path, tiny_model_dir, steps=4, save_steps=2)
    full = {"PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "VF_TEST_FULL_DISK": os.path.join(".staging", "checkpoint-4", "trainer_state.json")}  # fmt: skip
    r, pid = run_command("vf-rl", "@", cfg, env=full, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    line = error_line(r.stderr)
    assert f"no space left on device while saving checkpoint-4 (writing {out}/.staging/checkpoint-4/" \
           "trainer_state.json): No space left on device; checkpoint-2 is intact and a resume starts from it" \
           in line, line  # fmt: skip
    assert not (out / ".staging" / "checkpoint-4").exists()  # the half-written save does not hold the space
    assert problem(out / "checkpoint-2", use_lora=True) is None and not (out / "checkpoint-4").exists()
    assert not _gone(pid)
    # space freed: the same command resumes from the previous checkpoint
    r, pid = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"verifiers-rl: resuming from {out}/checkpoint-2 (step 2 of 4)" in r.stderr
    assert steps(out) == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------- 6. a dead server


def test_a_killed_server_is_restarted_and_the_same_step_goes_on(tmp_path, tiny_model_dir):
    from runs import server_pids

    out = tmp_path / "out"
    proc = start(write_cfg(tmp_path, tiny_model_dir, steps=8))  # room after each kill: the run must meet it
    wait_for_step(proc, out, 1)
    for kill in range(2):
        victims = server_pids(proc.pid)
        assert victims
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        if kill == 0:  # the second kill comes after a step served by the replacement, so each restart is 1 in a row
            replacement = lambda old=set(victims): set(server_pids(proc.pid)) - old  # noqa: E731
            wait_until(replacement, 120, "a server replacing the killed one", proc=proc)
            wait_for_step(proc, out, max(steps(out)) + 2)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    restarts = [x for x in err.splitlines() if "restarting it" in x]
    assert len(restarts) == 2, err[-3000:]  # one line per restart
    assert all("was killed by signal 9; restarting it (1 of 2 in a row)" in x for x in restarts), restarts
    assert "Aborted rollout" not in err  # not one line per lost request
    assert steps(out) == list(range(1, 9))  # the same step goes on: one row per step
    import json

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["server_restarts"] for r in rows if "reward" in r][-1] == 2
    assert all(r["rollouts_errored"] == 0 for r in rows if "reward" in r)  # lost requests were generated again
    assert (out / "logs" / "inference.log").read_text().count("Application startup complete") == 3
    assert not _gone(proc.pid)


def test_a_server_the_trainer_spawned_is_restarted_in_process(tmp_path, tiny_model_dir):
    import json

    from rl_envs import reverse_env
    from transformers import TrainerCallback

    from verifiers_rl.trainer import RLConfig, RLTrainer

    class KillTheServerAfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:  # the next batch is generating against it
                os.kill(trainer.runtime.session.process.process.pid, signal.SIGKILL)

    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, batch_size=8, rollouts_per_example=4, micro_batch_size=4,
                    max_tokens=4, max_seq_len=128, max_steps=3, save_strategy="no", log_completions=False,
                    server_mode="spawn")  # fmt: skip
    trainer = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args, callbacks=[KillTheServerAfterStep1()])
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.state.global_step == 3 and trainer.runtime.recovery.total == 1
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollouts_errored"] == 0 for r in rows), rows


def _user_server(model: str, port: int, log):
    """`vf-vllm` started by hand in another shell, on `port`."""
    import subprocess

    from procs import BIN

    proc = subprocess.Popen(
        [str(BIN / "vf-vllm"), "--engine", "cpu", "--model", model, "--port", str(port), "--max-model-len", "512"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    wait_healthy(f"http://127.0.0.1:{port}", proc=proc)
    return proc


def _kill_group(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.mark.parametrize("comes_back", [True, False])
def test_a_connected_server_that_dies_is_awaited_then_the_run_stops_with_the_command_that_resumes(
    tmp_path, tiny_model_dir, comes_back
):
    import subprocess

    from procs import BIN

    from verifiers_rl.config.net import free_port
    from verifiers_rl.export.checkpoints import checkpoints, problem

    port, out = free_port(), tmp_path / "out"
    grace = 60 if comes_back else 3
    cfg = write_cfg(tmp_path, tiny_model_dir, steps=4, extra=f"server_restart_grace = {grace}\n",
                    replace={'engine = "cpu"': f'engine = "cpu"\nport = {port}'})  # fmt: skip
    log = open(tmp_path / "user-server.log", "ab")
    server = _user_server(tiny_model_dir, port, log)
    trainer = subprocess.Popen([str(BIN / "vf-train"), "@", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:
        wait_for_step(trainer, out, 1)
        _kill_group(server)
        if comes_back:
            server = _user_server(tiny_model_dir, port, log)
        _, err = trainer.communicate(timeout=600)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        _kill_group(server)
        log.close()
    waited = [x for x in err.splitlines() if f"waiting up to server_restart_grace={grace}s" in x]
    assert len(waited) == 1 and f"the inference server at http://127.0.0.1:{port} does not answer /health" in waited[0]
    if comes_back:
        assert trainer.returncode == 0, err[-3000:]
        assert steps(out) == [1, 2, 3, 4]
        return
    assert trainer.returncode == 1, err[-3000:]
    line = error_line(err, "vf-train")
    assert f"it did not come back within server_restart_grace={grace}s; server http://127.0.0.1:{port}; start it " \
           f"again, then run `vf-train @ {cfg}` again: it resumes from the last checkpoint" in line, line  # fmt: skip
    saved = checkpoints(out)  # the last completed step is kept
    assert saved and int(saved[0].name.split("-")[1]) == max(steps(out)) and problem(saved[0], use_lora=True) is None


def test_vf_rl_restarts_the_server_its_trainer_processes_use(tmp_path, tiny_model_dir, capsys):
    """On GPUs vf-rl runs the trainer in processes of its own, connected to the server vf-rl owns: vf-rl restarts
    that server (same port and token) and the trainers wait for it. The GPU trainers cannot run here: a process
    that only waits stands in for them; the server and its kill are real."""
    import subprocess
    import sys
    import threading

    import httpx

    from verifiers_rl.scripts.rl import supervise
    from verifiers_rl.serving.launcher import InferenceServer

    server = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path)
    server.start()
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    code: list[int] = []
    watch = threading.Thread(target=lambda: code.append(supervise(trainer, server, restarts=2, poll_s=0.2)))
    watch.start()
    try:
        port, token, first = server.port, server.token, server.process.pid
        os.killpg(first, signal.SIGKILL)
        wait_until(lambda: server.process is not None and server.process.pid != first, 120,
                   "supervise() starting a replacement server")  # fmt: skip
        server.client.wait_for_health(120)
        assert server.port == port and server.process.pid != first
        auth = {"Authorization": f"Bearer {token}"}  # the trainers' token still opens the control routes
        assert httpx.get(f"http://127.0.0.1:{port}/weight_info", headers=auth).status_code == 200
    finally:
        trainer.terminate()
        watch.join(30)
        server.stop()
    assert code == [-signal.SIGTERM]
    printed = [x for x in capsys.readouterr().out.splitlines() if "restarting it" in x]
    assert printed == [f"vf-rl: inference server (pid {first}) was killed by signal 9; restarting it (1 of 2), log: "
                       f"{tmp_path}/logs/inference.log"], printed  # fmt: skip
