"""The stages of benchmarks/gpu_check.py. Each runs in a worker process of its own (a fresh CUDA context, killed
with its process group at its deadline) and writes what it saw to a JSON file as it goes, so a stage killed at its
deadline still leaves its record. The parent turns the records into check lines."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

# A fixed prompt (token ids, valid for every vocabulary here) whose next tokens the server samples with a fixed seed:
# the server's logprobs of them are compared before and after each sync, and with the trainer's own.
PROMPT = [1, 5, 9, 42, 7, 11, 3, 17]
PROBE_TOKENS = 6

# name: (RLConfig overrides). bf16 = true with the model given by path: the trainer loads it as on CUDA (LoRA: a
# bf16 base and float32 adapters; full fine-tuning: float32 master weights, models.training_kwargs). The learning
# rates are large on purpose: one step must move the served logprobs far beyond the bf16 rounding.
TRAIN_STAGES = {
    "lora-bf16": {"lora_sync": "merged", "bf16": True, "learning_rate": 5e-2},
    "full-bf16": {"use_lora": False, "bf16": True, "learning_rate": 1e-2},
    # sync_changed_only: the diff against the last-sent copy runs on the trainer's device (sync/delta.py)
    "full-bf16-changes": {"use_lora": False, "bf16": True, "learning_rate": 1e-2, "sync_changed_only": True},
}
MEMORY_STAGES = {"memory-lora": True, "memory-full": False}  # name: use_lora


class Record:
    """The stage's findings, rewritten to `path` on every change."""

    def __init__(self, path: str, **fields):
        self.path, self.data = Path(path), dict(fields)
        self.save()

    def __setitem__(self, key, value):
        self.data[key] = value
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        os.replace(tmp, self.path)


def error_line(e: BaseException) -> str:
    last = (str(e).strip().splitlines() or [""])[-1]
    return f"{type(e).__name__}: {last}"[:500]


# ---------------------------------------------------------------------------------------------- training stages


def server_probe(client) -> tuple[list[int], list[float]]:
    """The server's sampled tokens after PROMPT and its logprob of each (seeded: the same draws every time)."""
    body = {"prompt": PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 1.0, "seed": 0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    choice = client.post("/v1/completions", body, timeout=60)["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


def trainer_logprobs(model, tokens: list[int], bf16: bool) -> list[float]:
    """The trainer model's logprobs of `tokens` after PROMPT, computed as it trains (bf16 autocast under bf16)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([PROMPT + tokens], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits.float()
    finally:
        model.train(was_training)
    lp = torch.log_softmax(logits[0, len(PROMPT) - 1 : -1], dim=-1)
    return lp.gather(1, ids[0, len(PROMPT) :, None]).squeeze(1).tolist()


def break_sync() -> None:
    """--break-sync: every sync after the first moves nothing and tells the server nothing (what a lost sync
    looks like from the server), so the sync checks must fail."""
    from verifiers_rl.sync.policy_sync import PolicySync

    real = PolicySync.sync

    def skipped(self, export, version, changed=True):
        return real(self, export, version, changed) if version == 0 else 0.0

    PolicySync.sync = skipped


def train_stage(name: str, model_dir: str, work: str, steps: int, cpu: bool, broken: bool, rec: Record) -> None:
    import verifiers as vf
    from runs import tiny_rl_config
    from transformers import TrainerCallback

    from verifiers_rl.trainer import RLTrainer

    if broken:
        break_sync()
    args = tiny_rl_config(
        Path(work), output_dir=os.path.join(work, name), max_steps=steps, max_tokens=8, max_seq_len=128,
        max_prompt_len=None, use_cpu=cpu, report_to="none", server_engine="cpu", sync_backend="gloo",
        max_async_level=0, disable_tqdm=True, **TRAIN_STAGES[name],
    )  # fmt: skip
    rec["changed_only"] = bool(args.sync_changed_only)
    env = vf.load_environment(
        "reverse-text", num_train_examples=32, num_eval_examples=4, system_prompt="Reverse the text."
    )
    trainer = RLTrainer(model=model_dir, env=env, args=args)
    probes: list[dict] = []
    syncs: list[dict] = []

    class SyncProbe(TrainerCallback):
        """Added last, so it runs after SyncWeights: at train begin and after each step's sync."""

        def probe(self, step: int) -> None:
            client = trainer.runtime.client
            version = client.weight_version()  # GET /weight_info: the server's own version
            tokens, served = server_probe(client)
            mine = trainer_logprobs(trainer.accelerator.unwrap_model(trainer.model), tokens, args.bf16)
            probes.append({"step": step, "server_version": version, "tokens": tokens, "server": served,
                           "trainer": mine})  # fmt: skip
            rec["probes"] = probes

        def on_train_begin(self, a, state, control, **kw):
            self.probe(0)
            sender = trainer.runtime.client.sender
            send = sender.send

            def recorded(tensors, version):  # each sync's bytes, whether it was a diff, what the copy then holds
                snapshot = getattr(sender, "changes", None)  # sync_changed_only's last-sent copy (sync/delta.py)
                diffs = getattr(snapshot, "diffed", 0)
                stats = send(tensors, version)
                syncs.append(
                    {"version": version, "bytes": stats.bytes, "diff": getattr(snapshot, "diffed", 0) > diffs,
                     "snapshot": getattr(snapshot, "version", None)}
                )  # fmt: skip
                rec["syncs"] = syncs
                return stats

            sender.send = recorded

        def on_step_end(self, a, state, control, **kw):
            self.probe(state.global_step)

    trainer.add_callback(SyncProbe())
    try:
        t0 = time.perf_counter()
        trainer.train()
        rec["train_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failed check; the probes so far are still judged
        traceback.print_exc()
        rec["error"] = error_line(e)
    finally:
        params = list(trainer.model.parameters())
        rec["param_devices"] = sorted({p.device.type for p in params})
        rec["frozen_dtypes"] = sorted({str(p.dtype)[6:] for p in params if not p.requires_grad})
        rec["trainable_dtypes"] = sorted({str(p.dtype)[6:] for p in params if p.requires_grad})
        trainer.close()
        rec["closed"] = True


# ---------------------------------------------------------------------------------------------- memory stages


# One micro-batch of 4 x 1024 tokens as the trainer packs rollouts of mixed lengths under SDPA (rows as wide as
# the longest sample, shorter samples sharing a row): positions restart inside rows, so transformers builds the
# block-diagonal mask and repeats k/v, the case the planner counts. Equal-length samples would fill one row each
# and run maskless, a smaller peak than the planner's.
SAMPLE_LENGTHS = (1024, 700, 324, 600, 424, 512, 512)


def packed_microbatch(vocab: int, row_len: int, lengths=SAMPLE_LENGTHS):
    """The trainer's own collation (batch.microbatches.collate_packed) of `lengths` scaled to `row_len`."""
    import torch

    from verifiers_rl.batch.microbatches import collate_packed
    from verifiers_rl.batch.samples import Sample

    lengths = [n * row_len // 1024 for n in lengths]
    samples = [
        Sample(input_ids=torch.randint(0, vocab, (n,)).tolist(), loss_mask=[k >= n // 4 for k in range(n)],
               sampler_logprobs=[0.0] * n, advantage=1.0, rollout=i)
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    return collate_packed(samples, row_len)


def train_steps(model, head, opt, vocab: int, row_len: int, steps: int, lengths=SAMPLE_LENGTHS) -> int:
    """`steps` optimizer steps of two packed micro-batches each, as the trainer accumulates them: the first one's
    gradients live through the second one's activations, the peak the planner counts (with one micro-batch a step,
    no gradient exists at the peak). Returns the tokens of one micro-batch."""
    import torch

    from verifiers_rl.loss.forward import token_logprobs

    device = next(model.parameters()).device
    tokens = 0
    for _ in range(steps):
        for _ in range(2):
            mb = packed_microbatch(vocab, row_len, lengths).to(device)
            tokens = int(mb.input_ids.numel())
            with torch.autocast(device.type, torch.bfloat16):
                logprobs, _ = token_logprobs(model, head, mb, 1.0)
                loss = -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tokens


def memory_setup(use_lora: bool, small: bool, device: str):
    """What the trainer loads under bf16 = true on the Qwen3-0.6B shape (random weights, built offline; `small`: a
    small shape, the same code): a bf16 base with the trainer's adapter under LoRA, float32 master weights in full;
    AdamW and the head as the loss applies it. Returns (model, head, optimizer, config)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from verifiers_rl.config.lora import lora_config, wrap_lora
    from verifiers_rl.models import training_kwargs
    from verifiers_rl.plan.memory import KNOWN
    from verifiers_rl.sync.export import ReplicatedExport

    _, hidden, inter, layers, heads, kv, head_dim, vocab, tied = KNOWN["qwen3-0.6b"]
    if small:
        hidden, inter, layers, heads, kv, head_dim, vocab = 64, 128, 2, 4, 2, 16, 1024
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      tie_word_embeddings=tied)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(training_kwargs(use_lora).get("dtype", torch.bfloat16))
    if use_lora:
        model = wrap_lora(model, lora_config(16))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return model, ReplicatedExport(model), opt, cfg


def planner_estimate(cfg, use_lora: bool, tokens: int, row_len: int) -> dict[str, int]:
    """plan.memory.rank_parts for one DDP rank of this step."""
    from verifiers_rl.plan.memory import ModelShape, rank_parts

    return rank_parts(ModelShape.from_config(cfg), layout="ddp", ranks=1, use_lora=use_lora, lora_rank=16,
                      micro_batch_tokens=tokens, max_seq_len=row_len, activation_checkpointing=False,
                      param_bytes=2)  # fmt: skip


def memory_stage(use_lora: bool, cpu: bool, rec: Record, steps: int = 3) -> None:
    """Peak allocated memory of the trainer's forward/backward/AdamW on the Qwen3-0.6B shape against the planner's
    estimate for one DDP rank: packed micro-batches of 4 x 1024 tokens, two a step, under bf16 autocast
    (accelerate's, under bf16 = true). CPU: a small shape, the same code, no measurement."""
    import torch

    row_len = 64 if cpu else 1024  # the micro-batch holds 4 rows (SAMPLE_LENGTHS)
    if not cpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, head, opt, cfg = memory_setup(use_lora, small=cpu, device="cpu" if cpu else "cuda")
    tokens = train_steps(model, head, opt, cfg.vocab_size, row_len, steps)
    est = planner_estimate(cfg, use_lora, tokens, row_len)
    rec["shape"] = {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
                    "tokens": tokens, "row": row_len}  # fmt: skip
    rec["master_dtypes"] = sorted({str(p.dtype)[6:] for p in model.parameters() if p.requires_grad})
    rec["planner_allocated_bytes"] = est["total"] - est["cuda_context"]  # max_memory_allocated omits the context
    rec["planner_parts"] = est
    if not cpu:
        torch.cuda.synchronize()
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    rec["done"] = True


def run(stage: str, result: str, model_dir: str, work: str, steps: int, cpu: bool, broken: bool) -> None:
    rec = Record(result, stage=stage, pid=os.getpid())
    t0 = time.perf_counter()
    try:
        if stage in TRAIN_STAGES:
            train_stage(stage, model_dir, work, steps, cpu, broken, rec)
        else:
            memory_stage(MEMORY_STAGES[stage], cpu, rec)
    except BaseException as e:  # noqa: BLE001 - the parent prints it as a failed check
        traceback.print_exc()
        rec["error"] = error_line(e)
    rec["worker_s"] = time.perf_counter() - t0
