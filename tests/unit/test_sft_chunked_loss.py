"""vf-sft's chunked completion loss (`scripts/sft_loss.py`) at Qwen3's 151,936-row vocabulary: TRL's loss, gradients
and token accuracy to float tolerance, and a forward+backward peak a fraction of TRL's full-logits one.

The peak is measured with test_memory_measured.py's LiveBytes (live tensor storages under a TorchDispatchMode),
parameters and their gradients left out. `python tests/unit/test_sft_chunked_loss.py` writes the figures at a
realistic batch to benchmarks/results/sft_vocab_peak.json.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from test_memory_measured import LiveBytes  # noqa: E402  (tests/unit is on sys.path, as for conftest's ports)

VOCAB = 151_936  # Qwen3's embedding rows


def _model(hidden: int = 64, checkpointing: bool = True):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).train()
    if checkpointing:  # vf-sft's default (activation_checkpointing = true)
        model.activation_checkpointing_enable()
    return model


def _batch(batch: int, seq: int, seed: int = 0) -> dict:
    """Right-padded rows whose first third is prompt (-100) and whose tail is padding, as TRL's collator makes."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        attention_mask[row, seq - 3 * row :] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : seq // 3] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _trl_loss(model, batch: dict, num_items_in_batch):
    """What TRL's SFTTrainer.compute_loss takes (via Trainer.compute_loss): the model's own loss from its logits."""
    kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    return model(**batch, use_cache=False, **kwargs)


@pytest.mark.parametrize("num_items", [None, 40])
def test_chunked_loss_equals_trl_loss_and_gradients(num_items):
    from verifiers_rl.scripts.sft_loss import chunked_completion_loss

    torch.set_num_threads(1)
    model = _model(checkpointing=False)
    batch = _batch(3, 24)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    params = dict(model.named_parameters())

    out = _trl_loss(model, batch, num_items)
    ref_grads = torch.autograd.grad(out.loss, [params[n] for n in names])
    shifted = batch["labels"][:, 1:]
    trained = shifted != -100
    ref_hits = ((out.logits[:, :-1].argmax(-1) == shifted) & trained).sum()

    loss, stats = chunked_completion_loss(model, batch, num_items, chunk_size=7)  # chunks that split rows
    grads = torch.autograd.grad(loss, [params[n] for n in names])
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    for name, g, ref in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-7, msg=name)
    assert stats["count"].item() == trained.sum().item()
    assert stats["hits"].item() == ref_hits.item()


def peaks(batch: int, seq: int, hidden: int = 64, full: bool = True) -> dict[str, int]:
    """Peak live bytes of one forward+backward, TRL's full-logits loss (unless not `full`) and the chunked one."""
    from verifiers_rl.scripts.sft_loss import chunked_completion_loss

    inputs = _batch(batch, seq)
    n = int((inputs["labels"][:, 1:] != -100).sum())
    result = {}
    for name, loss_of in [
        ("trl_full_logits", lambda m: _trl_loss(m, inputs, n).loss),
        ("chunked", lambda m: chunked_completion_loss(m, inputs, n)[0]),
    ][0 if full else 1 :]:
        model = _model(hidden)
        with LiveBytes(model) as live:
            loss_of(model).backward()
            grads = live.serials([p.grad for p in model.parameters() if p.grad is not None])
        result[name] = live.peak(leave_out=grads)
    return result


def test_chunked_loss_peak_is_bounded_at_qwen_vocabulary():
    torch.set_num_threads(1)
    batch, seq = 4, 128
    measured = peaks(batch, seq)
    logits_bytes = batch * seq * VOCAB * 4  # the batch's float32 logits, once
    assert measured["trl_full_logits"] > logits_bytes  # TRL's path holds them (and more)
    # one ~110-row chunk of logits (64 MiB) and its softmax, plus the backward's [V, H] buffers, whatever the batch
    # size: here ~240 MB against ~930 MB (benchmarks/results/sft_vocab_peak.json for 8 x 256 and 16 x 512)
    assert measured["chunked"] < 0.3 * measured["trl_full_logits"], measured


def test_trainer_uses_the_chunked_loss_and_logs_trls_metrics(qwen_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from verifiers_rl.scripts.sft_loss import ChunkedSFTTrainer

    torch.set_num_threads(1)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"say {i}"}],
            "completion": [{"role": "assistant", "content": f"{i} " * (i + 1)}],
        }
        for i in range(4)
    ]
    args = SFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        activation_checkpointing=False,
    )
    model = _model(checkpointing=False)
    trainer = ChunkedSFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=qwen_tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    n = (batch["labels"][:, 1:] != -100).sum()
    assert trainer._chunked(model, batch)  # the setup vf-sft runs takes the chunked path
    loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=n)
    ref = SFTTrainer.compute_loss(trainer, model, dict(batch), num_items_in_batch=n)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    accuracy = trainer._metrics["train"]["mean_token_accuracy"]
    assert len(accuracy) == 2 and accuracy[0] == pytest.approx(accuracy[1])


if __name__ == "__main__":
    import json
    import platform
    import subprocess
    from datetime import date
    from pathlib import Path

    import transformers
    import trl

    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    rows = []
    # 16 x 512 through TRL's loss would need ~15 GB on this 23 GB machine: its chunked side only
    for batch, seq, full in [(8, 256, True), (16, 512, False)]:
        measured = peaks(batch, seq, full=full)
        rows.append({"batch": batch, "seq": seq, **measured, "fp32_logits_once": batch * seq * VOCAB * 4})
        print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    report = {
        "what": "peak live tensor storage (bytes) of one SFT forward+backward, LiveBytes of tests/unit/"
        "test_memory_measured.py, parameters and their gradients left out: TRL's loss (the model's logits, "
        "transformers' ForCausalLMLoss) against vf-sft's chunked completion loss (scripts/sft_loss.py)",
        "model": f"Qwen3, vocab {VOCAB}, hidden 64, 2 layers, tied embeddings, float32, activation checkpointing",
        "layout": "right-padded rows, first third prompt (-100), completion-only loss",
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}, 1 torch thread, CPU",
        "commit": commit, "date": date.today().isoformat(),
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "rows": rows,
    }  # fmt: skip
    out = repo / "benchmarks" / "results" / "sft_vocab_peak.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
