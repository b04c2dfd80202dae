"""The planner's activation estimate against the peak one forward+backward really holds, measured on CPU.

The model has Qwen3-0.6B's layer shape (hidden 1024, intermediate 3072, 16 heads, 8 kv heads, head_dim 128) with
two layers and a 512-token vocabulary, in bf16 under bf16 autocast with SDPA (as the trainer runs under
bf16 = true), LoRA on the project's default targets and full fine-tuning, with and without activation
checkpointing. The step is the trainer's: one packed row of two samples (position_ids restart, so transformers
builds a block-diagonal mask), hidden states out, the head applied by chunked_logprobs at the trained positions.

How the peak is measured: CPU tensors have no allocator statistics, and the profiler's CPU memory events proved
unusable here (they came back unordered, frees without their allocations). `LiveBytes`, a TorchDispatchMode, sees
every tensor an operator returns, records a storage the first time it appears (its bytes and a serial number) and
watches it with a weakref finalizer on the storage, which fires when the last tensor using it is gone (torch keeps
one Python object per live storage). The running sum of those allocations and frees is the live memory of the
step; its maximum is the peak. Parameters and buffers existed before the step and are left out; so are the
parameters' gradients (by serial number, not address, since the allocator reuses freed addresses), which the
planner counts as trainable state, not activations.
"""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from verifiers_rl.plan.memory import ModelShape, activation_bytes, logprob_bytes  # noqa: E402

TOKENS = (128, 128)  # two samples packed in one row


class LiveBytes(TorchDispatchMode):
    """Allocations and frees of tensor storages created while the mode is active (see the module's docstring)."""

    def __init__(self, model):
        super().__init__()
        self.before = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.live: dict[int, tuple[int, int]] = {}  # address -> (serial, bytes)
        self.events: list[tuple[int, int]] = []  # (serial, +bytes allocated / -bytes freed)

    def _free(self, address: int) -> None:
        serial, size = self.live.pop(address)
        self.events.append((serial, -size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                address = storage.data_ptr()
                if address and address not in self.live and address not in self.before:
                    self.live[address] = (len(self.events), storage.nbytes())
                    self.events.append((len(self.events), storage.nbytes()))
                    weakref.finalize(storage, self._free, address)
        return out

    def serials(self, tensors) -> set[int]:
        return {self.live[t.untyped_storage().data_ptr()][0] for t in tensors}

    def peak(self, leave_out: set[int]) -> int:
        now = top = 0
        for serial, size in self.events:
            if serial not in leave_out:
                now += size
                top = max(top, now)
        return top


def _model(use_lora: bool, checkpointing: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from verifiers_rl.config.lora import lora_config, wrap_lora

    cfg = Qwen3Config(
        vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    if checkpointing:  # as RLTrainer has transformers do it: non-reentrant, inputs requiring grad under LoRA
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if use_lora:
        model = wrap_lora(model, lora_config(16))
        if checkpointing:
            model.enable_input_require_grads()
    return model


def _step(model) -> None:
    """forward.token_logprobs' path for a head every rank holds: hidden states out, chunked logprobs."""
    from verifiers_rl.loss.logprobs import chunked_logprobs

    n = sum(TOKENS)
    ids = torch.randint(0, 512, (1, n))
    positions = torch.cat([torch.arange(k) for k in TOKENS])[None]
    trained = torch.ones(1, n - 1, dtype=torch.bool)
    trained[:, : n // 4] = False
    with torch.autocast("cpu", torch.bfloat16):  # bf16 = true: accelerate runs the forward under autocast
        out = model(input_ids=ids, position_ids=positions, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1][:, :-1]
        logprobs, _ = chunked_logprobs(hidden[trained], model.get_output_embeddings().weight, ids[:, 1:][trained])
    (-logprobs.sum()).backward()


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared two-core machine more threads made each step 3-5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_activation_estimate_matches_the_measured_peak(use_lora, checkpointing, one_thread):
    model = _model(use_lora, checkpointing)
    with LiveBytes(model) as memory:
        _step(model)
    grads = memory.serials(p.grad for p in model.parameters() if p.grad is not None)
    assert grads or use_lora is False  # LoRA's adapters have gradients too
    measured = memory.peak(leave_out=grads)
    shape = ModelShape.from_config(model.config)
    tokens = sum(TOKENS)
    estimate = activation_bytes(
        shape,
        use_lora=use_lora,
        lora_rank=16,
        micro_batch_tokens=tokens,
        max_seq_len=max(TOKENS),
        activation_checkpointing=checkpointing,
    ) + logprob_bytes(shape, trains_head=False, tokens=tokens)  # fmt: skip  (the head's gradient is a gradient)
    # measured 0.93-1.08; the estimate without autocast's bf16 copy of LoRA's inputs was 1.21 (too wide before)
    assert 0.9 <= estimate / measured <= 1.1, (estimate / 2**20, measured / 2**20)
