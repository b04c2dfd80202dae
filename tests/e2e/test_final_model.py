"""The trained model, ready to use, from one short real run (tiny model, CPU engine over HTTP, real peft):
`final/` (merged model + adapter + card) loads, equals the adapter applied to its base and the trainer's own
policy, serves through `vf-vllm`, answers verifiers' `vf-eval`, and is what `push_to_hub` uploads; `vf-rl export`
writes the same from a checkpoint; the run's wandb (offline) and TensorBoard files hold its metrics and
completions; transformers, peft and accelerate raise no deprecation warnings along the way.

The hub upload is the one thing intercepted: `HfApi.create_repo` / `HfApi.upload_folder` record their arguments
(and the uploaded folder's files) instead of calling the hub, which this machine cannot reach.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import httpx
import pytest
import torch
import verifiers as vf
from procs import BIN
from safetensors.torch import load_file
from servers import VLLM_PYTHON, start_server
from transformers import AutoModelForCausalLM, AutoTokenizer
from waits import wait_healthy
from wandb_files import history, offline_run, tables

from verifiers_rl.config.net import free_port
from verifiers_rl.scripts.rl import run_command
from verifiers_rl.trainer import RLConfig, RLTrainer

ENV_ARGS = {"system_prompt": "Reverse the text.", "num_train_examples": 32, "num_eval_examples": 4}
LIBRARIES = ("transformers", "peft", "accelerate")


class HubRecorder:
    """Stands in for the two HfApi calls a push makes; what they were given is checked by the tests."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def patch(self, mp: pytest.MonkeyPatch) -> None:
        from huggingface_hub import HfApi, RepoUrl

        recorder = self

        def create_repo(api, repo_id, **kw):
            recorder.calls.append(("create_repo", {"repo_id": repo_id, **kw}))
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(api, **kw):
            root = Path(kw["folder_path"])
            files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
            recorder.calls.append(("upload_folder", {**kw, "files": files}))
            return "commit-info"

        mp.setattr(HfApi, "create_repo", create_repo)
        mp.setattr(HfApi, "upload_folder", upload_folder)


def library_deprecations(caught) -> list[str]:
    """FutureWarning / DeprecationWarning raised from inside transformers, peft or accelerate."""
    out = []
    for w in caught:
        parts = Path(w.filename).parts
        if issubclass(w.category, (FutureWarning, DeprecationWarning)) and any(lib in parts for lib in LIBRARIES):
            out.append(f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}")
    return out


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """One real run: eval before, 2 LoRA steps (norms trained in full too), a checkpoint and an eval at step 2,
    wandb (offline) and TensorBoard on, push_to_hub on; every warning recorded."""
    root = tmp_path_factory.mktemp("final-run")
    hub = HubRecorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(root))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_PROJECT", "verifiers-rl-tests")
        hub.patch(mp)
        args = RLConfig(
            output_dir=str(root / "run"),
            run_name="tiny-final",
            rollouts_per_example=4,
            batch_size=16,
            micro_batch_size=8,
            max_steps=2,
            max_tokens=8,
            max_seq_len=128,
            learning_rate=5e-3,
            lora_rank=4,
            lora_alpha=8,
            lora_modules_to_save=["norm"],
            use_cpu=True,
            seed=7,
            save_strategy="steps",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            num_eval_examples=4,
            report_to=["wandb", "tensorboard"],
            log_completions=True,
            num_completions_to_log=3,
            push_to_hub=True,
            hub_model_id="someone/tiny-reverse",
            hub_token="hf_secret_token",
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            env = vf.load_environment("reverse-text", **ENV_ARGS)
            trainer = RLTrainer(model=tiny_model_dir, env=env, args=args)
            trainer.evaluate(metric_key_prefix="eval_before")
            trainer.train()
        import wandb

        wandb.finish()  # flush the offline run's files before they are read
    trainer.model.eval()
    yield {"root": root, "out": Path(args.output_dir), "trainer": trainer, "hub": hub, "warnings": list(caught)}
    trainer.close()


# --------------------------------------------------------------------------------------------- final/


def test_final_is_a_complete_model_with_its_card(run, tiny_model_dir):
    final = run["out"] / "final"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (final / name).exists(), name
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (final / "adapter" / name).exists(), name
    manifest = json.loads((final / "vf_rl_export.json").read_text())
    assert manifest["step"] == 2 and manifest["kind"] == "merged+adapter"
    for name, size in manifest["files"].items():
        assert (final / name).stat().st_size == size, name
    assert not list(run["out"].glob(".final*")), "staging folder left behind"
    assert AutoTokenizer.from_pretrained(final).chat_template
    card = (final / "README.md").read_text()
    assert tiny_model_dir in card and "`reverse-text`" in card and "2 optimizer steps" in card
    assert "| eval_before | 0 |" in card and "| eval | 2 |" in card  # the eval before RL and the one at step 2
    assert "![reward curve](reward_curve.png)" in card and (final / "reward_curve.png").stat().st_size > 1000
    assert '"lora_rank": 4' in card and "hf_secret_token" not in card and "hub_token" not in card
    assert "vf-eval reverse-text -m MODEL_DIR" in card
    info = json.loads((final / "vf_rl_run.json").read_text())
    assert info["env_id"] == "reverse-text" and info["env_args"]["system_prompt"] == "Reverse the text."


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_merged_equals_adapter_applied_and_the_trainers_policy(run, tiny_model_dir):
    from peft import PeftModel

    from verifiers_rl.config.lora import quiet_peft_wrap

    final = run["out"] / "final"
    ids = [[3, 17, 100, 42, 250, 7, 9, 61], [120, 5, 5, 77, 201, 13, 1, 2]]
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    with quiet_peft_wrap():
        applied = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final / "adapter")
    policy = run["trainer"].model
    reference = _logits(policy, ids)
    assert (_logits(merged, ids) - reference).abs().max() < 1e-5
    assert (_logits(applied.eval(), ids) - reference).abs().max() < 1e-5
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    trained = load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(base[k], trained[k]) for k in base), "the export holds the base weights"
    # merged out of place: the trainer's base weights are the model it started from, bit for bit
    state = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in policy.named_parameters()}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(state[name].detach(), base[name]), name


def _serve(model_dir: Path, log: Path):
    """`vf-vllm --engine cpu --model DIR` started as a user starts it; returns (process, base url)."""
    port = free_port()
    cmd = [str(BIN / "vf-vllm"), "--engine", "cpu", "--model", str(model_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc=proc, log=log)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, url


def _vf_eval(url: str, model: str, out_dir: Path) -> list[dict]:
    cmd = [
        sys.executable, "-m", "verifiers.scripts.eval", "reverse-text", "-m", model, "-b", url + "/v1",
        "-k", "VF_TEST_KEY", "-n", "2", "-r", "1", "-t", "8", "-S", json.dumps({"seed": 3}),
        "-a", json.dumps(ENV_ARGS), "-d", "-s", "-o", str(out_dir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "VF_TEST_KEY": "x"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [results] = list(out_dir.rglob("results.jsonl"))
    return [json.loads(line) for line in results.read_text().splitlines()]


def test_vf_vllm_serves_final_as_trained_and_vf_eval_runs_against_it(run, tmp_path):
    final = run["out"] / "final"
    trainer = run["trainer"]
    proc, url = _serve(final, tmp_path / "server.log")
    try:
        body = {
            "model": str(final),
            "messages": [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "abcdef"}],
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        prompt, completion = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
        served = torch.tensor([t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]])
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        policy = torch.log_softmax(logits.float(), -1)
        assert completion == policy.argmax(-1).tolist(), "greedy decoding differs from the trainer's policy"
        expected = policy.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        assert (served - expected).abs().max() < 1e-4
        rows = _vf_eval(url, str(final), tmp_path / "eval")
        assert len(rows) == 2 and all(r["error"] is None and 0.0 <= r["reward"] <= 1.0 for r in rows)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="set VF_VLLM_PYTHON to the vLLM CPU venv's python")
def test_real_vllm_serves_final_as_trained(run, tmp_path):
    """vLLM (its CPU build) loads final/ as any model and samples the trainer's greedy completion."""
    final = run["out"] / "final"
    server = start_server("vllm", str(final), tmp_path)
    try:
        body = {"model": str(final), "messages": [{"role": "user", "content": "abcdef"}], "max_tokens": 8}
        body.update(temperature=0.0, logprobs=True, return_token_ids=True)
        reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.stop()
    prompt, completion = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    with torch.no_grad():
        logits = run["trainer"].model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    policy = torch.log_softmax(logits.float(), -1)
    assert completion == policy.argmax(-1).tolist()
    served = torch.tensor([t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]])
    assert (served - policy.gather(1, torch.tensor(completion)[:, None]).squeeze(1)).abs().max() < 1e-4


# --------------------------------------------------------------------------------------------- vf-rl export


def test_vf_rl_export_writes_the_same_model_from_a_checkpoint(run, tmp_path, capsys):
    final, checkpoint = run["out"] / "final", run["out"] / "checkpoint-2"
    assert run_command(["export", str(checkpoint), str(tmp_path / "both")]) == 0
    merged = load_file(str(tmp_path / "both" / "model.safetensors"))
    reference = load_file(str(final / "model.safetensors"))
    assert merged.keys() == reference.keys() and all(torch.equal(merged[k], reference[k]) for k in merged)
    assert (tmp_path / "both" / "adapter" / "adapter_model.safetensors").exists()
    card = (tmp_path / "both" / "README.md").read_text()
    assert "`reverse-text`" in card and "| eval | 2 |" in card  # from the checkpoint's run record and log
    assert "vf-vllm --model" in capsys.readouterr().out

    assert run_command(["export", str(checkpoint), str(tmp_path / "adapter"), "--adapter"]) == 0
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    reference = load_file(str(final / "adapter" / "adapter_model.safetensors"))
    assert adapter.keys() == reference.keys() and all(torch.equal(adapter[k], reference[k]) for k in adapter)
    assert not (tmp_path / "adapter" / "model.safetensors").exists()

    assert run_command(["export", str(checkpoint), str(tmp_path / "merged"), "--merge"]) == 0
    assert not (tmp_path / "merged" / "adapter").exists() and (tmp_path / "merged" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{ckpt}", "{tmp}/o", "--merge", "--adapter"], "--merge and --adapter exclude each other"),
        (["{ckpt}", "{final}"], "exists and is not empty: pass --force to replace it"),
        (["{out}", "{tmp}/o"], "is a run's output folder: export one of its checkpoint-2, final folders"),
        (["{final}", "{tmp}/o", "--adapter"], "--adapter needs a LoRA checkpoint"),
        (["{tmp}/missing", "{tmp}/o"], "is not a folder"),
        (["{ckpt}"], "usage: vf-rl export CHECKPOINT OUT"),
        (["{zero}", "{tmp}/o"], "sharded DeepSpeed ZeRO states (global_step*/) and no consolidated weights"),
        (["{dcp}", "{tmp}/o"], "sharded torch.distributed.checkpoint (FSDP, *.distcp)"),
    ],
)
def test_vf_rl_export_errors_are_one_line(run, tmp_path, capsys, argv, message):
    zero = tmp_path / "zero"
    (zero / "global_step2").mkdir(parents=True)
    (zero / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    dcp = tmp_path / "dcp" / "pytorch_model_fsdp_0"
    dcp.mkdir(parents=True)
    (dcp / "__0_0.distcp").write_bytes(b"")
    paths = dict(ckpt=run["out"] / "checkpoint-2", final=run["out"] / "final", out=run["out"], tmp=tmp_path)
    paths.update(zero=zero, dcp=dcp.parent)
    code = run_command(["export", *[a.format(**paths) for a in argv]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------- hub


def test_push_to_hub_uploads_final_once_at_the_end(run):
    calls = run["hub"].calls
    assert [name for name, _ in calls] == ["create_repo", "upload_folder"], "checkpoints must not be pushed"
    assert calls[0][1]["repo_id"] == "someone/tiny-reverse" and calls[0][1]["exist_ok"]
    upload = calls[1][1]
    assert upload["repo_id"] == "someone/tiny-reverse" and Path(upload["folder_path"]) == run["out"] / "final"
    for name in (
        "model.safetensors",
        "config.json",
        "README.md",
        "reward_curve.png",
        "adapter/adapter_model.safetensors",
    ):
        assert name in upload["files"], name
    assert "step 2" in upload["commit_message"]


def test_a_failed_push_keeps_the_model_and_says_how_to_push_it(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    from verifiers_rl.errors import TrainingError
    from verifiers_rl.export.hub import push_folder

    def refuse(api, repo_id, **kw):
        raise OSError("401 Client Error: Unauthorized\nmore detail")

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    (tmp_path / "final").mkdir()
    with pytest.raises(TrainingError) as e:
        push_folder(tmp_path / "final", "someone/model")
    assert "401 Client Error: Unauthorized" in str(e.value) and "more detail" not in str(e.value)
    assert f"hf upload someone/model {tmp_path / 'final'}" in str(e.value)


# --------------------------------------------------------------------------------------------- logging


def test_wandb_offline_run_holds_our_metrics_and_the_completions_table(run):
    run_dir = offline_run(run["root"])
    rows = history(run_dir)
    train = [r for r in rows if "train/reward" in r]
    assert [r["train/global_step"] for r in train] == [1, 2]
    for key in ("train/loss", "train/entropy", "train/mismatch_kl", "train/timing/sync_s", "train/tokens_per_s"):
        assert all(key in r for r in train), key
    metrics = [json.loads(x) for x in (run["out"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/reward"] for r in train] == [m["reward"] for m in metrics if "reward" in m]
    # charted where a user looks for them: eval/reward (the eval at step 2), eval/before/reward, never train/eval/...
    assert any("eval/before/reward" in r for r in rows) and any("eval/reward" in r for r in rows)
    assert not [k for r in rows for k in r if k.startswith("train/eval")]
    logged = [r for r in rows if r.get("completions/_type") == "table-file"]
    assert sorted(r["train/global_step"] for r in logged) == [1, 2]
    written = tables(run_dir, "completions")
    assert len(written) == 2
    for table in written:
        assert table["columns"] == ["step", "prompt", "completion", "reward"] and len(table["data"]) == 3
        assert all("Reverse the text." in prompt for _, prompt, _, _ in table["data"])


def test_tensorboard_events_hold_our_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = {p.parent for p in (run["out"] / "runs").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    rewards = [(e.step, e.value) for e in acc.Scalars("train/reward")]
    metrics = [json.loads(x) for x in (run["out"] / "metrics.jsonl").read_text().splitlines()]
    assert rewards == [(m["step"], pytest.approx(m["reward"])) for m in metrics if "reward" in m]
    for tag in ("train/loss", "train/entropy", "train/timing/step_s", "eval/reward", "eval/before/reward"):
        assert tag in scalars, tag


def test_no_deprecation_warnings_from_transformers_peft_or_accelerate(run, tmp_path):
    from transformers import TrainingArguments

    with warnings.catch_warnings(record=True) as control:  # the check sees such a warning when there is one
        warnings.simplefilter("always")
        TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True)
    assert library_deprecations(control)
    assert not library_deprecations(run["warnings"])
