"""RLTrainer end to end on CPU: tiny model, real CPU engine over HTTP, real gloo sync, real peft."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from rl_envs import again_env, reverse_env
from runs import tiny_rl_config as _args

from verifiers_rl.trainer import RLConfig, RLTrainer


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def _lora_b(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}


def test_single_turn_steps_log_sync_and_checkpoint(tiny_model_dir, tmp_path):
    args = _args(
        tmp_path,
        max_async_level=1,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        keep_server=True,
    )
    trainer = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args)
    before = _lora_b(trainer.model)
    try:
        trainer.train()
        client = trainer.runtime.client
        assert client.weight_version() == "2"  # one sync per optimizer step
        assert client.sender.shared_memory  # our CPU engine on this machine: buckets through /dev/shm (shm.py)
        metrics = _metrics(args.output_dir)
        assert [m["step"] for m in metrics] == [1, 2]
        for m in metrics:
            assert 0.0 <= m["reward"] <= 1.1
            for key in (
                "loss",
                "entropy",
                "mismatch_kl",
                "ratio_mean",
                "frac_reward_zero_std",
                "timing/sync_s",
                "timing/generation_s",
                "tokens_per_s",
                "async_lag",
                "padding_frac",
                "rewards/char_match",
            ):
                assert key in m, key
            # the step's wall time, log line to log line, is its stages plus the framework's rest (step_timing.py)
            stages = ("rollouts_wait", "train", "optimizer", "sync", "framework")
            assert sum(m[f"timing/{k}_s"] for k in stages) == pytest.approx(m["timing/wall_s"], abs=1e-6)
            assert m["timing/optimizer_s"] > 0 and 0 < m["timing/framework_frac"] < 0.5
        # step 1 is on-policy: trainer and sampler agree; step 2 trains on rollouts of the previous policy
        assert abs(metrics[0]["ratio_mean"] - 1.0) < 1e-4 and metrics[0]["mismatch_kl"] < 1e-6
        assert metrics[0]["async_lag"] == 0 and metrics[1]["async_lag"] == 1
        assert metrics[1]["mismatch_kl"] > metrics[0]["mismatch_kl"]
        after = _lora_b(trainer.model)
        assert any(not torch.equal(before[k], after[k]) for k in before), "LoRA weights did not change"
        ckpt = Path(args.output_dir) / "checkpoint-2"
        for name in (
            "optimizer.pt",
            "scheduler.pt",
            "rng_state.pth",
            "trainer_state.json",
            "orchestrator.pt",
            "adapter_model.safetensors",
        ):
            assert (ckpt / name).exists(), name
        evals = [json.loads(x) for x in (Path(args.output_dir) / "metrics.jsonl").read_text().splitlines()]
        assert any("eval/reward" in r and r["step"] == 2 for r in evals), "eval_steps did not evaluate"
        eval_metrics = trainer.evaluate()
        assert eval_metrics["eval/rollouts"] == 4 and "eval/reward" in eval_metrics
    finally:
        trainer.close()
    assert trainer.runtime.session.process is None
    assert (Path(args.output_dir) / "logs" / "inference.log").exists()


def test_a_bf16_model_trains_with_bf16_mixed_precision(tiny_model_dir, tmp_path):
    """What every GPU config runs: weights loaded in bf16 (get_model's CUDA default) and bf16 = true. Accelerate then
    returns the forward's hidden states as float32 beside the bf16 head; this stopped every GPU run at step 1 (found
    on an H200 by what is now benchmarks/gpu_check.py). Here the same dtypes on CPU: it trains, and the LoRA update
    syncs into the server."""
    from verifiers_rl.models import get_model, get_tokenizer

    model = get_model(tiny_model_dir, model_kwargs={"dtype": torch.bfloat16})
    args = _args(tmp_path, bf16=True, keep_server=True)
    trainer = RLTrainer(model=model, processing_class=get_tokenizer(tiny_model_dir), env=reverse_env(), args=args)
    before = _lora_b(trainer.model)
    try:
        trainer.train()
        assert trainer.runtime.client.weight_version() == "2"
    finally:
        trainer.close()
    assert any(not torch.equal(before[n], p) for n, p in _lora_b(trainer.model).items())
    metrics = _metrics(args.output_dir)
    assert len(metrics) == 2 and all(m["rollouts_errored"] == 0 for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics), metrics


def test_adapter_sync_on_the_cpu_engine_serves_the_policy(tiny_model_dir, tmp_path):
    """lora_sync='adapter' on our CPU engine: rollouts name the adapter ('policy'), each sync sends only A and B,
    and the server applies W0 + B @ A (through the slot engine's packed projections): on-policy steps show the
    sampler and the trainer agreeing, which they would not if a sync missed the weights the forward reads."""
    args = _args(tmp_path, lora_sync="adapter", max_async_level=0, keep_server=True)
    trainer = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args)
    try:
        trainer.train()
        assert trainer.runtime.session.model_name == "policy" and trainer.runtime.client.weight_version() == "2"
    finally:
        trainer.close()
    metrics = _metrics(args.output_dir)
    assert [m["rollouts_errored"] for m in metrics] == [0, 0]
    for m in metrics:  # step 2 samples from the synced step-1 adapter
        assert abs(m["ratio_mean"] - 1.0) < 1e-4 and m["mismatch_kl"] < 1e-6, m


def test_multi_turn_env_trains_each_turn_full_finetune(tiny_model_dir, tmp_path):
    args = _args(
        tmp_path,
        batch_size=8,
        rollouts_per_example=2,
        micro_batch_size=4,
        max_steps=1,
        max_async_level=0,
        max_tokens=4,
        use_lora=False,
        gradient_checkpointing=True,
        pack_sequences=False,
        learning_rate=1e-3,
        keep_server=True,
        sync_shared_memory=False,  # every byte of the full-model sync on gloo
    )
    trainer = RLTrainer(model=tiny_model_dir, env=again_env(), args=args)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        trainer.train()
        assert trainer.runtime.client.weight_version() == "1"
        assert not trainer.runtime.client.sender.shared_memory
    finally:
        trainer.close()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert "lm_head.weight" in changed and "model.layers.0.mlp.down_proj.weight" in changed
    m = _metrics(args.output_dir)[0]
    ok = m["rollouts"] - m["rollouts_errored"]
    assert m["turns_mean"] == 2.0
    assert m["samples"] == 2 * ok  # one training sample per turn


def _run(tiny_model_dir, out, steps, resume=None, **kw):
    # max_concurrent=1 fixes the engine's batch composition: CPU matmuls are not batch-invariant, so under load a
    # different grouping of requests can flip a near-tie token. What this test checks is resume, not batching.
    args = _args(out, max_steps=6, max_async_level=0, save_strategy="steps", save_steps=3, max_concurrent=1, **kw)
    trainer = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args)
    try:
        if steps < 6:
            trainer.args.max_steps = steps  # stop early but keep the 6-step schedule in the config
            trainer.state.max_steps = steps
        trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.close()
    return _metrics(args.output_dir), args.output_dir


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    full, _ = _run(tiny_model_dir, tmp_path / "full", 6)
    _run(tiny_model_dir, tmp_path / "split", 3)
    resumed, out = _run(tiny_model_dir, tmp_path / "split", 6, resume=True)
    assert [m["step"] for m in full] == [1, 2, 3, 4, 5, 6]
    tail = [m for m in resumed if m["step"] > 3]
    assert [m["step"] for m in tail] == [4, 5, 6]
    for a, b in zip(full[3:], tail):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_num_iterations_trains_each_batch_again_and_resumes_inside_a_batch(tiny_model_dir, tmp_path):
    """num_iterations=2 (TRL's name): each batch trains two optimizer steps, sampled once at the version of its
    first step; the checkpoint after step 3 falls between a batch's two steps, and the resumed run trains that
    same batch again (the checkpoint carries it) instead of sampling a new one with newer weights."""
    full, _ = _run(tiny_model_dir, tmp_path / "full", 6, num_iterations=2)
    assert [m["batch_iteration"] for m in full] == [0, 1] * 3
    assert [m["policy_version"] for m in full] == [0, 0, 2, 2, 4, 4]  # sampled once, at max_async_level=0
    for first, again in zip(full[::2], full[1::2]):
        assert again["reward"] == first["reward"] and again["timing/generation_s"] == 0.0
        assert first["mismatch_kl"] < 1e-6  # fresh batches are on-policy (and checked by the sync guard)
        assert again["mismatch_kl"] > 1e-6 and again["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    _run(tiny_model_dir, tmp_path / "split", 3, num_iterations=2)
    resumed, _ = _run(tiny_model_dir, tmp_path / "split", 6, resume=True, num_iterations=2)
    tail = [m for m in resumed if m["step"] > 3]
    assert [m["step"] for m in tail] == [4, 5, 6]
    for a, b in zip(full[3:], tail):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_trainer_and_engine_logprobs_agree_at_temperature(tiny_model_dir, tmp_path):
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    from verifiers_rl.batch.microbatches import collate_packed
    from verifiers_rl.batch.samples import Sample
    from verifiers_rl.loss.forward import token_logprobs
    from verifiers_rl.serving.launcher import InferenceServer
    from verifiers_rl.sync.export import ReplicatedExport

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    samples = []
    with InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path) as client:
        oai = OpenAI(base_url=client.base_url + "/v1", api_key="x")
        for seed in range(3):
            r = oai.chat.completions.create(
                model=tiny_model_dir,
                messages=[{"role": "user", "content": f"hi {seed}"}],
                max_tokens=12,
                temperature=0.7,
                seed=seed,
                logprobs=True,
                extra_body={"return_token_ids": True},
            )
            p, c = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
            lps = [x.logprob for x in r.choices[0].logprobs.content]
            samples.append(
                Sample(
                    input_ids=p + c,
                    loss_mask=[False] * len(p) + [True] * len(c),
                    sampler_logprobs=[0.0] * len(p) + lps,
                    advantage=1.0,
                    rollout=seed,
                )
            )
    mb = collate_packed(samples)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ReplicatedExport(model), mb, temperature=0.7)
    mask = mb.loss_mask
    assert torch.allclose(lp[mask], mb.sampler_logprobs[mask], atol=1e-4)


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(batch_size=10, rollouts_per_example=4),
            "batch_size=10: must be a positive multiple of rollouts_per_example=4",
        ),
        (dict(rollouts_per_example=1, batch_size=4), "rollouts_per_example=1: must be >= 2"),
        (dict(temperature=0.0), "temperature=0.0: must be > 0"),
        (dict(loss_type="ppo"), "loss_type='ppo': allowed: is, grpo, dapo, dr_grpo, gspo, cispo"),
        (dict(scale_rewards="z"), "scale_rewards='z': allowed: group, batch, none"),
        (dict(kl_beta=0.1, use_lora=False), "kl_beta=0.1: needs use_lora=True"),
        (dict(batch_size=16, micro_batch_size=32), "must be divisible by micro_batch_size * processes"),
        (dict(lora_sync="delta"), "lora_sync='delta': allowed: auto, merged, adapter"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        _args(tmp_path, **kw)


def test_verifiers_shim_exposes_our_classes():
    import verifiers as vf

    assert vf.RLTrainer is RLTrainer
    assert vf.RLConfig is RLConfig
    from verifiers_rl.trainer import GRPOConfig, GRPOTrainer, grpo_defaults, lora_defaults

    assert issubclass(vf.GRPOTrainer, RLTrainer) and vf.GRPOTrainer is GRPOTrainer
    with pytest.warns(DeprecationWarning, match="use RLConfig"):
        cfg = grpo_defaults("demo", use_cpu=True)
    assert isinstance(cfg, RLConfig) and cfg.output_dir == os.path.join("outputs", "demo")
    with pytest.warns(DeprecationWarning):
        lora = lora_defaults(r=4, alpha=8)
    assert lora.r == 4 and lora.lora_alpha == 8
    with pytest.warns(DeprecationWarning):
        assert isinstance(GRPOConfig(output_dir="x", use_cpu=True), RLConfig)


def test_long_prompts_are_filtered_once_and_counted():
    from datasets import Dataset

    from verifiers_rl.rollouts.prompts import filter_prompts
    from verifiers_rl.tiny import build_tokenizer

    tok = build_tokenizer()
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "x" * n}]} for n in (5, 50, 500)])
    kept, dropped = filter_prompts(ds, tok, max_prompt_len=100)
    assert dropped == 1 and len(kept) == 2
    assert filter_prompts(ds, tok, None) == (ds, 0)


def test_notebook_lifecycle_releases_the_server(tiny_model_dir, tmp_path):
    """A notebook kernel lives on: train() stops the server it spawned, evaluate() starts one again, a `with`
    block closes, and a second trainer in the same process does not collide with the first."""
    from procs import survivors

    with RLTrainer(model=tiny_model_dir, env=reverse_env(), args=_args(tmp_path / "a", max_steps=1)) as first:
        first.train()
        assert first.runtime.session.process is None and not survivors(os.getpid())  # nothing held after train()
        second = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=_args(tmp_path / "b", max_steps=1))
        second.train()
        assert not survivors(os.getpid())
        metrics = first.evaluate()  # a new server, with the trained weights
        assert 0.0 <= metrics["eval/reward"] <= 1.1 and first.runtime.session.process is not None
        assert second.evaluate()["eval/rollouts"] > 0
        second.close()
    assert first.runtime.session.process is None and not survivors(os.getpid())
