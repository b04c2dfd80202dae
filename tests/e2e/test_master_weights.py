"""Full fine-tuning under bf16 keeps float32 master weights and AdamW state: with bf16 weights and moments (what the
trainer had on CUDA, where models.get_model loads bf16), one AdamW step at lr 1e-6 is below half a bf16 ulp for
~98 % of the weights, which then never move. The real trainer step on CPU, under bf16 autocast, from a bf16
checkpoint loaded the way CUDA loads it; the server gets the compute dtype (bf16)."""

from __future__ import annotations

import torch
from rl_envs import reverse_env
from runs import tiny_rl_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl import models
from verifiers_rl.trainer import RLTrainer


def test_full_finetuning_under_bf16_moves_the_weights_at_lr_1e_6(tiny_model_dir, tmp_path, monkeypatch):
    ckpt = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(ckpt)
    monkeypatch.setattr(models, "default_dtype", lambda device: torch.bfloat16)  # get_model's choice on CUDA
    args = tiny_rl_config(
        tmp_path, use_lora=False, bf16=True, learning_rate=1e-6, max_steps=1, weight_decay=0.0, keep_server=True
    )
    trainer = RLTrainer(model=str(ckpt), env=reverse_env(), args=args)
    params = dict(trainer.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}  # master weights
    linear = {n: p.detach().clone() for n, p in params.items() if n.endswith("proj.weight")}
    try:
        trainer.train()
        assert trainer.runtime.client.weight_version() == "1"
        export = trainer.weight_export()
        assert {m.dtype for m in export.stream("merged").metas} == {torch.bfloat16}  # the compute dtype goes out
    finally:
        trainer.close()
    moved = sum(int((params[n].detach() != before).sum()) for n, before in linear.items())
    total = sum(p.numel() for p in linear.values())
    assert moved / total > 0.9, f"{moved} of {total} projection weights moved"
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}
