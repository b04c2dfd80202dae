"""Running `vf-rl` as a user does, for the fault suites: a config, the process, its steps and its one error line."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

from procs import BIN

RUN = """
model = "{model}"
output_dir = "{out}"
[env]
id = "reverse-text"
[env.args]
num_train_examples = 32
num_eval_examples = 4
[inference]
engine = "cpu"
[trainer.args]
max_steps = {steps}
rollouts_per_example = 4
batch_size = 8
micro_batch_size = 4
max_tokens = 8
max_seq_len = 512
save_steps = {save_steps}
log_completions = false
max_async_level = 1
"""


def write_cfg(
    tmp_path: Path, model: str, steps: int = 3, save_steps: int = 100, extra: str = "", replace: dict | None = None
) -> Path:
    """The tiny reverse-text run; `extra` lines go to [trainer.args]; `replace` edits the text (old -> new)."""
    text = textwrap.dedent(RUN.format(model=model, out=tmp_path / "out", steps=steps, save_steps=save_steps)) + extra
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def tiny_rl_config(tmp_path: Path, **kw):
    """The RLConfig of the in-process trainer tests: the tiny model's geometry, 2 steps, no checkpoints, a server of
    its own; `kw` wins."""
    from verifiers_rl.trainer import RLConfig

    base = dict(
        output_dir=str(tmp_path / "run"),
        rollouts_per_example=4,
        batch_size=16,
        micro_batch_size=8,
        max_steps=2,
        max_tokens=6,
        max_seq_len=96,
        max_prompt_len=64,
        learning_rate=5e-3,
        lora_rank=4,
        lora_alpha=8,
        use_cpu=True,
        seed=7,
        save_strategy="no",
        log_completions=False,
        # its own server, whatever listens on port 8000 (test_users_paths starts the user's server there, and a
        # test in another xdist worker must not train it)
        server_mode="spawn",
    )
    return RLConfig(**{**base, **kw})


def start(cfg: Path, *extra, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "vf-rl"), "@", str(cfg), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def steps(out: Path) -> list[int]:
    """Steps of metrics.jsonl's training rows, in file order."""
    from verifiers_rl.export.reward_curve import read_metrics

    return [row["step"] for row in read_metrics(out) if "reward" in row]


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if steps(out) and max(steps(out)) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"vf-rl ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout}s")


def error_line(stderr: str, prog: str = "vf-rl") -> str:
    lines = [x for x in stderr.splitlines() if x.startswith(f"{prog}: error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def server_pids(parent: int) -> list[int]:
    """Processes started for `parent` (the launcher's VF_PARENT_PID marker), never found by name."""
    marker = f"VF_PARENT_PID={parent}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                pids.append(int(pid))
        except OSError:
            continue
    return pids
