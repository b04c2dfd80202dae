"""A tiny peft LoRA model with a real (non-zero) adapter delta, shared by the weight-sync tests."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from verifiers_rl.tiny import build_tiny_model


def lora_model(seed: int = 0, **cfg):
    model, _ = build_tiny_model(seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **cfg)
    peft = get_peft_model(model, config)
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # B starts at zero: give the adapter a real delta
    return peft
