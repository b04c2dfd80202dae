"""Flows people migrating from upstream vf.RLTrainer run, offline with the tiny model (issue: users' paths).

Upstream taught two shells: `vf-vllm --model M` (port 8000), then a training script that names no server, run
with `python` or `accelerate launch`. The server the user started must be the one trained."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest
from ports import default_port_exclusive
from procs import BIN, ROOT, run_command, survivors
from waits import wait_healthy

from verifiers_rl.config.net import port_in_use
from verifiers_rl.serving.auth import read_token_file

UPSTREAM_SCRIPT = """
import verifiers as vf

model, tokenizer = vf.get_model_and_tokenizer({model!r})
env = vf.load_environment(env_id="reverse-text", num_train_examples=16, num_eval_examples=4)
args = vf.RLConfig(run_name="upstream-flow", output_dir={out!r}, batch_size=8, micro_batch_size=4,
                   rollouts_per_example=4, max_steps=2, max_tokens=8, max_seq_len=512, report_to="none",
                   save_strategy="no", log_completions=False)
trainer = vf.RLTrainer(model=model, processing_class=tokenizer, env=env, args=args)
trainer.train()
print("TRAINED", trainer.state.global_step)
"""


@pytest.fixture
def user_server(tiny_model_dir, tmp_path):
    """`vf-vllm --model M` started by hand in another shell: default port 8000, no launcher. No test on another
    pytest-xdist worker runs while it is up (tests/ports.py): their trainers would find it."""
    with default_port_exclusive():
        yield from _user_server(tiny_model_dir, tmp_path)


def _user_server(tiny_model_dir, tmp_path):
    if port_in_use("127.0.0.1", 8000):
        pytest.fail("port 8000 is taken: the upstream flow needs vf-vllm's default port free")
    log = open(tmp_path / "user-server.log", "wb")
    proc = subprocess.Popen(
        [str(BIN / "vf-vllm"), "--engine", "cpu", "--model", tiny_model_dir, "--max-model-len", "512"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_healthy("http://127.0.0.1:8000", proc=proc, log=tmp_path / "user-server.log")
        yield "http://127.0.0.1:8000"
    finally:
        with contextlib.suppress(ProcessLookupError):  # a server that exited early: the wait's error says why
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


# CI runs `accelerate launch` (what upstream's docs run; it starts the same script); plain python is `-m slow`
@pytest.mark.parametrize("launcher", [pytest.param("python", marks=pytest.mark.slow), "accelerate"])
@pytest.mark.timeout(900)  # its setup may wait for the other xdist worker's running test (tests/ports.py)
def test_server_the_user_started_is_the_one_trained(user_server, tiny_model_dir, tmp_path, launcher):
    script = tmp_path / "train_reverse_text.py"
    script.write_text(UPSTREAM_SCRIPT.format(model=tiny_model_dir, out=str(tmp_path / "run")))
    # vf-vllm started by hand guards its control routes with a token it leaves for this user's trainers
    auth = {"Authorization": f"Bearer {read_token_file(8000)}"}
    assert httpx.get(f"{user_server}/weight_info").status_code == 401
    before = httpx.get(f"{user_server}/weight_info", headers=auth).json()["weight_version"]
    cmd = [sys.executable, str(script)]
    if launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TRAINED 2" in r.stdout
    # one log line says which server is used, and that server received both steps' weights
    assert "using the cpu inference server already running at http://127.0.0.1:8000" in r.stderr
    assert httpx.get(f"{user_server}/weight_info", headers=auth).json()["weight_version"] == "2" != before
    assert not (tmp_path / "run" / "logs" / "inference.log").exists()  # no second server was spawned


def test_a_server_of_another_model_is_refused_before_any_weight_reaches_it(tiny_model_dir, tmp_path):
    """vf-vllm serving checkpoint A on the port a trainer of model B looks at: the trainer refuses it in one line,
    before its first sync (A's policy version stays 0), whether B has A's shape (another name) or another shape; a
    user who names that server explicitly (server_mode='connect') may train into a same-shape model of another name."""
    from rl_envs import reverse_env

    from verifiers_rl.config.net import free_port
    from verifiers_rl.serving.client import ServerError
    from verifiers_rl.tiny import save_tiny_model
    from verifiers_rl.trainer import RLConfig, RLTrainer

    port = free_port()
    log = open(tmp_path / "server-a.log", "wb")
    proc = subprocess.Popen(
        [str(BIN / "vf-vllm"), "--engine", "cpu", "--model", tiny_model_dir, "--port", str(port), "--max-model-len",
         "512"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc=proc, log=tmp_path / "server-a.log")
        auth = {"Authorization": f"Bearer {read_token_file(port)}"}
        same_shape = str(save_tiny_model(tmp_path / "model-b", seed=1))
        other_shape = str(save_tiny_model(tmp_path / "model-c", hidden=128))

        def train(model, **kw):
            args = RLConfig(output_dir=str(tmp_path / f"run-{len(os.listdir(tmp_path))}"), use_cpu=True,
                            vllm_server_port=port, batch_size=8, rollouts_per_example=4, micro_batch_size=4,
                            max_steps=1, max_tokens=4, max_seq_len=96, **kw)  # fmt: skip
            trainer = RLTrainer(model=model, env=reverse_env(), args=args)
            try:
                trainer.train()
            finally:
                trainer.close()

        with pytest.raises(
            ServerError,
            match=rf"the server at {base} is not one this trainer can sync into: it "
            rf"serves '{tiny_model_dir}', the trainer's model is '{same_shape}'.*server_mode='spawn'",
        ):
            train(same_shape)  # fmt: skip
        with pytest.raises(
            ServerError,
            match=r"its weights have another shape \(server vs trainer: hidden_size 64 vs "
            r"128, intermediate_size 128 vs 256",
        ):
            train(other_shape, server_mode="connect")  # fmt: skip
        assert httpx.get(f"{base}/weight_info", headers=auth).json()["weight_version"] == "0"  # nothing was sent
        train(same_shape, server_mode="connect")  # named explicitly: trained into, with a warning
        assert httpx.get(f"{base}/weight_info", headers=auth).json()["weight_version"] == "1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


class _NotAnInferenceServer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_foreign_listener_on_the_named_port_is_one_clear_error(tiny_model_dir, tmp_path):
    from rl_envs import reverse_env

    from verifiers_rl.serving.client import ServerError
    from verifiers_rl.trainer import RLConfig, RLTrainer

    httpd = http.server.HTTPServer(("127.0.0.1", 0), _NotAnInferenceServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_address[1]
        args = RLConfig(output_dir=str(tmp_path), use_cpu=True, vllm_server_port=port, batch_size=8,
                        rollouts_per_example=4, micro_batch_size=4, max_steps=1, max_tokens=4,
                        max_seq_len=96)  # fmt: skip
        trainer = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args)
        with pytest.raises(ServerError, match=f"vllm_server_port={port}: .*answered 404.*server_mode='spawn'"):
            trainer.train()
        trainer.close()
    finally:
        httpd.shutdown()


def _write(tmp_path, text: str, name="cfg.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def _one_error_line(r, prog="vf-rl") -> str:
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"{prog}: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


RL = """
model = "{model}"
output_dir = "{out}"
[env]
id = "reverse-text"
[env.args]
num_train_examples = 16
num_eval_examples = 4
[inference]
engine = "cpu"
{inference_args}
[trainer.args]
max_steps = 6
rollouts_per_example = 4
batch_size = 8
micro_batch_size = 4
max_tokens = 8
max_seq_len = 512
max_empty_steps = 2
save_strategy = "no"
log_completions = false
"""


def test_a_server_with_a_shorter_context_filters_prompts_by_its_own_rule(tiny_model_dir, tmp_path):
    # the server's context is shorter than the config plans for: the preflight runs again with the server's number
    # (its rule, so no request is rejected); here no prompt fits, which stops the run before its first step
    cfg = _write(
        tmp_path,
        RL.format(model=tiny_model_dir, out=tmp_path / "o", inference_args="[inference.args]\nmax_model_len = 100"),
    )
    r, pid = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    line = _one_error_line(r)
    assert "every one of the 16 prompts is longer than the prompt limit of 92 tokens" in line, line
    assert "start the server with a larger --max-model-len (it has 100), or lower max_tokens" in line
    assert "rollouts rejected" not in r.stderr  # no step ran
    assert not survivors(pid)


def test_every_prompt_filtered_is_an_error_before_anything_starts(tiny_model_dir, tmp_path):
    from rl_envs import reverse_env

    from verifiers_rl.errors import TrainingError
    from verifiers_rl.trainer import RLConfig, RLTrainer

    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, batch_size=8, rollouts_per_example=4, micro_batch_size=4,
                    max_tokens=8, max_seq_len=24)  # fmt: skip
    with pytest.raises(TrainingError, match="every one of the 12 prompts is longer than the prompt limit of 16 tokens"):
        RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args)


def test_every_rollout_erroring_stops_with_the_environments_error(tiny_model_dir, tmp_path):
    from rl_envs import sandbox_env_without_key

    from verifiers_rl.errors import TrainingError
    from verifiers_rl.trainer import RLConfig, RLTrainer

    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, batch_size=8, rollouts_per_example=4, micro_batch_size=4,
                    max_tokens=4, max_seq_len=128, max_steps=5, max_empty_steps=2, save_strategy="no",
                    log_completions=False)  # fmt: skip
    trainer = RLTrainer(model=tiny_model_dir, env=sandbox_env_without_key(), args=args)
    try:
        # one missing key fails every rollout alike: the run stops at the first step, naming it
        with pytest.raises(TrainingError, match="step 1: every one of the 8 rollouts failed .*PRIME_API_KEY"):
            trainer.train()
    finally:
        trainer.close()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("prog", ["rl", "train", "vllm"])
def test_exit_status_survives_verifiers_own_scripts(tmp_path, prog):
    """verifiers 0.1.14 installs vf-rl / vf-train / vf-vllm shims that call our main() and drop its return value."""
    bad = _write(tmp_path, "[trainr]\ngpus = 1\n")
    argv = ["--model", str(tmp_path / "missing"), "--engine", "cpu"] if prog == "vllm" else ["@", str(bad)]
    code = f"import sys; sys.argv = ['vf-{prog}', *{argv!r}]; from verifiers.scripts.{prog} import main; main()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])


def test_a_config_runs_from_any_directory(tmp_path):
    demo = ROOT / "configs" / "vf-rl" / "tiny-reverse-text.toml"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r, pid = run_command("vf-rl", "@", demo, "--dry-run", cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-2000:]
    sft = ROOT / "configs" / "vf-sft" / "tiny-reverse-text.toml"  # named relative to the config, not the cwd
    assert f"-m verifiers_rl.scripts.sft @ {sft.resolve()}" in r.stdout


@pytest.mark.parametrize(
    "text, message",
    [
        ("inference_gpu_ids = [0]\n[model]\nname = 'Qwen/Qwen3-0.6B'\n[orchestrator]\nbatch_size = 8\n",
         "this is a prime-rl config"),
    ],
)  # fmt: skip
def test_other_tools_configs_are_named(tmp_path, text, message):
    r, pid = run_command("vf-rl", "@", _write(tmp_path, text))
    assert r.returncode == 2 and message in _one_error_line(r)


def test_n_gpu_plan_uses_every_inference_gpu(tmp_path, tiny_model_dir):
    cfg = _write(
        tmp_path,
        f"""
        model = "{tiny_model_dir}"
        [env]
        id = "reverse-text"
        [inference]
        gpus = 4
        [inference.args]
        tensor_parallel_size = 2
        [trainer]
        gpus = 2
        [trainer.args]
        batch_size = 32
        rollouts_per_example = 4
        micro_batch_size = 4
        """,
    )
    r, pid = run_command("vf-rl", "@", cfg, "--dry-run", "--gpus", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 " in r.stdout and "--data-parallel-size 2" in r.stdout
    assert "--tensor-parallel-size 2" in r.stdout and "--num_processes 2" in r.stdout
    r, pid = run_command("vf-rl", "@", cfg, "--dry-run", "--gpus", "6", "--trainer.args.batch_size", "12")
    assert r.returncode == 2
    assert "batch_size=12 must be divisible by micro_batch_size * trainer processes = 4 * 2" in _one_error_line(r)


def test_one_gpu_plan_shares_it_with_a_memory_split():
    cfg = ROOT / "configs" / "vf-rl" / "reverse-text.toml"
    r, pid = run_command(
        "vf-rl", "@", cfg, "--dry-run", "--gpus", "1", "--inference.args.gpu_memory_utilization", "false"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "inference shares GPU 0 with the trainer on [0]" in out
    assert "each of 1 trainer rank(s)" in out and "GiB of 80.0 GiB" in out
    util = float(out.split("--gpu-memory-utilization ")[1].split()[0])
    assert f"vLLM --gpu-memory-utilization {util:.2f} on the same GPU" in out  # the split printed is the one run
    assert 0.5 < util < 0.95
    assert "weight sync: adapter weights over gloo, LoRA A/B only" in out
    # a 24 GiB card leaves vLLM less; a model that cannot fit is one line with what to change
    small = run_command("vf-rl", "@", cfg, "--dry-run", "--gpus", "1", "--gpu-memory", "24",
                        "--inference.args.gpu_memory_utilization", "false")[0]  # fmt: skip
    assert float(small.stdout.split("--gpu-memory-utilization ")[1].split()[0]) < util
    no_user_util = ("--inference.args.gpu_memory_utilization", "false")
    full = run_command(
        "vf-rl", "@", cfg, "--dry-run", "--gpus", "1", "--gpu-memory", "4", "--trainer.args.use_lora", "false",
        *no_user_util,
    )[0]  # fmt: skip
    assert full.returncode == 2 and "the 4.0 GiB GPU it shares with vLLM" in full.stderr
    assert "LoRA (use_lora = true)" in full.stderr and "a second GPU" in full.stderr
