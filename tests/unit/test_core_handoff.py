"""The CPU engine's idle cores lent to training (core_handoff.py), on a real tiny Qwen3 with a real LoRA adapter:
the training thread widens mid-pass once generation is over, and never while it runs; narrowing gives the cores
back and counts the seconds; results do not depend on the switch."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from verifiers_rl.inference.cpu.core_handoff import CoreHandoff


@pytest.fixture
def lora_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_widens_mid_forward_once_generation_ends_and_narrows_back(lora_model, threads):
    seen: list[int] = []
    calls = {"n": 0}

    def generating() -> bool:  # the batch in flight finishes while the first layer runs
        calls["n"] += 1
        seen.append(torch.get_num_threads())
        return calls["n"] < 2

    handoff = CoreHandoff(1, 2, generating)
    hooked = handoff.attach(lora_model)
    assert hooked == sum(1 for m in lora_model.modules() if list(m.parameters(recurse=False)))
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    _step(lora_model, ids)
    assert seen == [1, 1]  # asked at the embedding (busy), then at the next module (idle): widened, not asked again
    assert handoff.wide and torch.get_num_threads() == 2
    handoff.narrow()
    assert not handoff.wide and torch.get_num_threads() == 1
    assert handoff.take_lent_seconds() > 0.0
    assert handoff.take_lent_seconds() == 0.0  # counted once


def test_backward_asks_too_and_a_busy_server_keeps_the_trainer_narrow(lora_model, threads):
    asked = {"forward": 0, "backward": 0}
    phase = {"backward": False}

    def generating() -> bool:
        asked["backward" if phase["backward"] else "forward"] += 1
        return True

    handoff = CoreHandoff(1, 2, generating)
    handoff.attach(lora_model)
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = lora_model(input_ids=ids, labels=ids).loss
    phase["backward"] = True
    loss.backward()
    hooked = sum(1 for m in lora_model.modules() if list(m.parameters(recurse=False)))
    assert asked["forward"] == hooked  # every module with weights, before its forward
    assert asked["backward"] > 2 * lora_model.config.num_hidden_layers  # gradients arrive all through backward
    assert torch.get_num_threads() == 1 and handoff.take_lent_seconds() == 0.0
    handoff.detach()
    lora_model(input_ids=ids)
    assert asked["forward"] == hooked  # no hooks left


def test_the_switch_does_not_change_loss_or_gradients(lora_model, threads):
    ids = torch.randint(3, 250, (4, 64), generator=torch.Generator().manual_seed(2))
    plain = _step(lora_model, ids)
    handoff = CoreHandoff(1, 2, lambda: False)
    handoff.attach(lora_model)
    switched = _step(lora_model, ids)
    handoff.narrow()
    assert torch.equal(plain[0], switched[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], switched[1]))


def test_rejects_an_empty_share():
    with pytest.raises(ValueError, match="narrow=0"):
        CoreHandoff(0, 2, lambda: False)


def test_widening_in_backward_reaches_the_training_thread(lora_model, threads):
    """CPU backward runs on the thread that called it: a gradient hook's switch sizes that thread's next ops."""
    phase = {"backward": False}
    handoff = CoreHandoff(1, 2, lambda: not phase["backward"])  # busy through forward, idle once backward starts
    handoff.attach(lora_model)
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(3))
    loss = lora_model(input_ids=ids, labels=ids).loss
    assert torch.get_num_threads() == 1 and not handoff.wide
    phase["backward"] = True
    loss.backward()
    assert handoff.wide and torch.get_num_threads() == 2
    handoff.narrow()
    assert torch.get_num_threads() == 1
