"""Training-throughput benchmark: token-budget packed micro-batches (ours) vs naive right-padded micro-batches, and the
peak memory of chunked vs full-vocabulary logprobs.

    .venv/bin/python benchmarks/bench_train.py [--quick]

(a) One rollout batch of mixed-length samples (seeded; lengths uniform in [min_len, max_len], the last ~60% of
    each sample trained) through a LoRA'd tiny Qwen3: forward (`forward.token_logprobs`, the trainer's path) plus a
    simple policy-gradient loss and backward over the whole batch, no optimizer step. tokens/s = real (unpadded)
    tokens of the batch / seconds.
    - naive: fixed `micro_batch_size` samples in dataset order, right-padded to the longest of each micro-batch
      (`collate_padded`).
    - ours: what RLTrainer does with pack_sequences=True under SDPA: `plan_microbatches(lengths, micro_batch_size *
      max_seq_len, packed=True, max_samples=micro_batch_size)` + `collate_packed(group, row_len=longest sample)`
      (rows as wide as the micro-batch's longest sample, short samples sharing a row; block-diagonal attention per row).
    - also reported: the same token budget with no sample cap (a larger micro_batch_size), length-bucketed
      padded micro-batches (pack_sequences=False), and one packed row per micro-batch (the layout flash-attention
      runs as varlen; under SDPA a dense [N, N] block-diagonal mask, which is why the trainer caps rows there).
    - diagnostic (full mode): an RL-shaped batch (64 samples of 140..165 tokens) at micro_batch_size 64 and 8,
      packed vs padded.
    Variants run interleaved, one warm-up each, median of N rounds.
(b) `logprobs.chunked_logprobs` vs `logprobs.full_logprobs` forward+backward at Qwen3's vocabulary (V=151936,
    hidden 512, N=2048 tokens, float32), each in a fresh subprocess: peak RSS (VmHWM, reset once the inputs exist)
    minus the RSS right after the inputs (hidden, LM head, targets) are allocated. Also the time of one
    forward+backward (median of N).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import arg_parser, finish, median, row, wait_for_quiet  # noqa: E402

if TYPE_CHECKING:
    from verifiers_rl.batch.microbatches import MicroBatch
    from verifiers_rl.batch.samples import Sample

NAME = "bench_train"
CEILING_GOAL = 0.95  # packed vs padded: fraction of the speedup that removing the padding allows
MEMORY_GOAL = 0.5


# ---------------------------------------------------------------------------------------- (a) micro-batching


def make_samples(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[Sample]:
    from verifiers_rl.batch.samples import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        prompt = max(1, int(length * 0.4))
        out.append(
            Sample(
                input_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=[False] * prompt + [True] * (length - prompt),
                sampler_logprobs=[0.0] * length,
                advantage=rng.uniform(-1.0, 1.0),
                rollout=i,
            )
        )
    return out


def naive_microbatches(samples: list[Sample], micro_batch_size: int, pad_id: int) -> list[MicroBatch]:
    from verifiers_rl.batch.microbatches import collate_padded

    return [collate_padded(samples[i : i + micro_batch_size], pad_id) for i in range(0, len(samples), micro_batch_size)]


def planned_microbatches(
    samples: list[Sample], budget: int, packed: bool, max_samples: int | None, pad_id: int, rows: bool = False
) -> list[MicroBatch]:
    """rows=True: packed rows as wide as the micro-batch's longest sample (RLTrainer._packed_row_len under SDPA);
    False: one packed row per micro-batch (the flash-attention layout)."""
    from verifiers_rl.batch.microbatches import collate_packed, collate_padded, plan_microbatches

    plan = plan_microbatches([len(s.input_ids) for s in samples], budget, packed=packed, max_samples=max_samples)
    groups = [[samples[i] for i in idx] for idx in plan]
    width = lambda g: max(len(s.input_ids) for s in g) if rows else None  # noqa: E731
    return [collate_packed(g, width(g), pad_id) if packed else collate_padded(g, pad_id) for g in groups]


def step_seconds(model, head, mbs: list[MicroBatch]) -> float:
    """Forward + simple PG loss + backward over every micro-batch (one optimizer step's worth of compute)."""
    from verifiers_rl.loss.forward import token_logprobs

    n_loss = sum(mb.num_loss_tokens for mb in mbs)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for mb in mbs:
        logprobs, _ = token_logprobs(model, head, mb, 1.0)
        adv = mb.advantages
        adv = adv[:, None] if adv.dim() == 1 else adv
        loss = -(logprobs * adv * mb.loss_mask).sum() / n_loss
        loss.backward()
    return time.perf_counter() - t0


def time_variants(model, head, variants: dict[str, list[MicroBatch]], real: int, repeats: int, log, tag: str) -> dict:
    from verifiers_rl.batch.microbatches import padding_fraction

    for mbs in variants.values():
        step_seconds(model, head, mbs[:1])  # warm-up: one micro-batch of each layout
    secs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):  # interleaved, so background load hits every variant alike
        for k, mbs in variants.items():
            secs[k].append(step_seconds(model, head, mbs))
    out = {}
    for k, mbs in variants.items():
        sec = median(secs[k])
        out[k] = v = {
            "seconds": sec,
            "all_seconds": secs[k],
            "tokens_per_s": real / sec,
            "microbatches": len(mbs),
            "padding_frac": padding_fraction(mbs),
            "slots": sum(m.num_real_tokens + m.num_padded_tokens for m in mbs),
            "longest_row": max(m.input_ids.shape[1] for m in mbs),
        }
        log(
            f"{tag} {k}: {v['microbatches']} micro-batches (longest row {v['longest_row']}), padding "
            f"{v['padding_frac']:.1%}, {v['tokens_per_s']:.0f} tok/s"
        )
    return out


def microbatch_throughput(quick: bool, log) -> dict:
    from peft import LoraConfig, get_peft_model

    from verifiers_rl.config.rl_config import DEFAULT_LORA_TARGETS
    from verifiers_rl.sync.export import ReplicatedExport
    from verifiers_rl.tiny import build_tiny_model

    hidden, layers = (128, 2) if quick else (256, 4)
    n, min_len, max_len, mbs_size = (16, 32, 256, 4) if quick else (64, 32, 512, 8)
    repeats = 1 if quick else 3
    model, tok = build_tiny_model(hidden=hidden, layers=layers, seed=0)
    torch.manual_seed(0)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=32, target_modules=DEFAULT_LORA_TARGETS, task_type="CAUSAL_LM")
    )
    model.train()
    head = ReplicatedExport(model)  # the trainer's path to the output head
    pad = tok.pad_token_id
    samples = make_samples(n, min_len, max_len, 256, seed=0)
    real = sum(len(s.input_ids) for s in samples)
    budget = mbs_size * max_len  # RLConfig.token_budget = micro_batch_size * max_seq_len
    variants = {
        "naive": naive_microbatches(samples, mbs_size, pad),
        # RLTrainer under SDPA: packed rows as wide as the micro-batch's longest sample (trainer._packed_row_len)
        "packed": planned_microbatches(samples, budget, True, mbs_size, pad, rows=True),
        "packed_uncapped": planned_microbatches(samples, budget, True, None, pad, rows=True),
        "bucketed_padded": planned_microbatches(samples, budget, False, mbs_size, pad),
        # one row per micro-batch: the flash-attention layout, run through SDPA's dense block-diagonal mask
        "packed_one_row": planned_microbatches(samples, budget, True, mbs_size, pad),
    }
    out = {
        "model": {"hidden": hidden, "layers": layers, "lora_rank": 8},
        "samples": n,
        "lengths": [min_len, max_len],
        "real_tokens": real,
        "micro_batch_size": mbs_size,
        "token_budget": budget,
        "repeats": repeats,
        "variants": time_variants(model, head, variants, real, repeats, log, "mixed"),
    }
    if not quick:
        # diagnostic: an RL-shaped batch (64 samples of 140..165 tokens, like reverse-text rollouts) with
        # micro_batch_size 64 / max_seq_len 256 (one packed row of ~9.7k tokens) vs 8, packed vs padded
        rl = make_samples(64, 140, 165, 256, seed=1)
        rl_real = sum(len(s.input_ids) for s in rl)
        rl_variants = {
            "padded_mbs64": planned_microbatches(rl, 64 * 256, False, 64, pad),
            "packed_mbs64": planned_microbatches(rl, 64 * 256, True, 64, pad, rows=True),
            "padded_mbs8": planned_microbatches(rl, 8 * 256, False, 8, pad),
            "packed_mbs8": planned_microbatches(rl, 8 * 256, True, 8, pad, rows=True),
        }
        out["rl_shaped"] = {
            "samples": 64,
            "lengths": [140, 165],
            "real_tokens": rl_real,
            "variants": time_variants(model, head, rl_variants, rl_real, repeats, log, "rl-shaped"),
        }
    return out


# ---------------------------------------------------------------------------------------- (b) logprobs memory


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _peak_rss_bytes() -> int:
    # VmHWM is this address space's high-water mark. Not getrusage's ru_maxrss: Linux carries that across exec
    # from the forked copy of the parent, so a child of a 5 GB benchmark process starts with a 5 GB "peak".
    return _status_bytes("VmHWM")


def memory_child(method: str, vocab: int, hidden: int, n: int, repeats: int, chunk_size: int | None = None) -> dict:
    """Runs in a fresh process: peak RSS of one forward+backward of `method` above the RSS of its inputs."""
    from verifiers_rl.loss import logprobs as L

    torch.manual_seed(0)
    fn = {"chunked": L.chunked_logprobs, "full": L.full_logprobs}[method]
    h = (torch.randn(n, hidden) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    # materialise the gradient buffers too: both methods need them, they are not what differs
    w.grad = torch.zeros_like(w)
    h.grad = torch.zeros_like(h)
    try:  # reset the high-water mark to now (Linux >= 4.0), so setup temporaries do not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _rss_bytes()
    peak_before = _peak_rss_bytes()
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lp, _ = fn(h, w, targets, chunk_size=chunk_size)  # with_entropy=True, as the trainer calls it
        lp.sum().backward()
        secs.append(time.perf_counter() - t0)
        del lp
    peak = _peak_rss_bytes()
    return {
        "method": method,
        "chunk_size": chunk_size or L.auto_chunk_size(vocab),
        "rss_inputs": base,
        "peak_rss": peak,
        "peak_before_run": peak_before,
        "peak_over_inputs": peak - base,
        "seconds": median(secs),
        "all_seconds": secs,
        "logits_bytes": n * vocab * 4,
    }


def logprobs_memory(quick: bool, log) -> dict:
    vocab, hidden, n = (32768, 256, 2048) if quick else (151936, 512, 2048)
    repeats = 1 if quick else 2
    out = {"vocab": vocab, "hidden": hidden, "tokens": n, "repeats": repeats}
    # "chunked" uses the trainer's default chunk size (logprobs.auto_chunk_size(V)); "chunked_1024" is a diagnostic
    runs = [("full", "full", 0), ("chunked", "chunked", 0)] + ([] if quick else [("chunked_1024", "chunked", 1024)])
    for label, method, chunk in runs:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--memory-child",
            method,
            str(vocab),
            str(hidden),
            str(n),
            str(repeats),
            str(chunk),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            raise RuntimeError(f"memory child {label} failed: {res.stderr[-2000:]}")
        out[label] = m = json.loads(res.stdout.strip().splitlines()[-1])
        log(
            f"logprobs {label}: peak {m['peak_over_inputs'] / 2**20:.0f} MiB over inputs "
            f"(logits would be {m['logits_bytes'] / 2**20:.0f} MiB), {m['seconds']:.2f}s fwd+bwd"
        )
    return out


# ---------------------------------------------------------------------------------------- run


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results: dict = {"name": NAME, "quick": quick}
    results["machine_before"] = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    mb = results["microbatching"] = microbatch_throughput(quick, log)
    mem = results["logprobs_memory"] = logprobs_memory(quick, log)

    v = mb["variants"]
    naive, packed = v["naive"], v["packed"]
    sp = packed["tokens_per_s"] / naive["tokens_per_s"]
    desc = (
        f"{mb['samples']} samples, len {mb['lengths'][0]}..{mb['lengths'][1]}, LoRA Qwen3 h{mb['model']['hidden']}"
        f"x{mb['model']['layers']}"
    )
    # Packing only removes padding, so its speedup is bounded by the ratio of tokens computed: the honest goal
    # is the fraction of that ceiling reached, not a fixed multiple that depends on the length mix.
    ceiling = (1 - packed["padding_frac"]) / (1 - naive["padding_frac"])  # every sample has tokens: padding < 1
    reached = sp / ceiling
    rows = [
        row(
            f"fwd+bwd tok/s: padded mbs={mb['micro_batch_size']} vs packed budget {mb['token_budget']} ({desc}); "
            f"ratio as a fraction of the padding ceiling {ceiling:.2f}x",
            naive["tokens_per_s"],
            packed["tokens_per_s"],
            reached,
            f">={CEILING_GOAL:.0%} of ceiling",
            reached >= CEILING_GOAL,
            unit="tok/s",
            speedup=sp,
            ceiling=ceiling,
        ),
        row("padding fraction: naive vs packed", naive["padding_frac"], packed["padding_frac"], None, "(report)", None),
        row(
            "fwd+bwd tok/s: padded vs packed, no sample cap",
            naive["tokens_per_s"],
            v["packed_uncapped"]["tokens_per_s"],
            v["packed_uncapped"]["tokens_per_s"] / naive["tokens_per_s"],
            "(report)",
            None,
            unit="tok/s",
        ),
        row(
            "fwd+bwd tok/s: padded vs length-bucketed padded",
            naive["tokens_per_s"],
            v["bucketed_padded"]["tokens_per_s"],
            v["bucketed_padded"]["tokens_per_s"] / naive["tokens_per_s"],
            "(report)",
            None,
            unit="tok/s",
            padding_frac=v["bucketed_padded"]["padding_frac"],
        ),
    ]
    po = v["packed_one_row"]
    rows.append(
        row(
            f"fwd+bwd tok/s: padded vs one packed row per micro-batch (longest {po['longest_row']} tokens; the "
            "flash-attention layout, under SDPA)",
            naive["tokens_per_s"],
            po["tokens_per_s"],
            po["tokens_per_s"] / naive["tokens_per_s"],
            "(report)",
            None,
            unit="tok/s",
        )
    )
    if "rl_shaped" in mb:
        rv = mb["rl_shaped"]["variants"]
        for size in (64, 8):
            a, b = rv[f"padded_mbs{size}"], rv[f"packed_mbs{size}"]
            rows.append(
                row(
                    f"RL-shaped batch (64 x 140..165 tok), micro_batch_size {size}: padded vs packed "
                    f"(longest packed row {b['longest_row']})",
                    a["tokens_per_s"],
                    b["tokens_per_s"],
                    b["tokens_per_s"] / a["tokens_per_s"],
                    "(report)",
                    None,
                    unit="tok/s",
                )
            )
    full, chunked = mem["full"], mem["chunked"]
    mr = chunked["peak_over_inputs"] / max(full["peak_over_inputs"], 1)
    tag = f"V={mem['vocab']}, H={mem['hidden']}, N={mem['tokens']}, chunk {chunked['chunk_size']}"
    rows += [
        row(
            f"logprobs fwd+bwd peak RSS over inputs: full vs chunked ({tag})",
            full["peak_over_inputs"] / 2**20,
            chunked["peak_over_inputs"] / 2**20,
            mr,
            f"<={MEMORY_GOAL}x",
            mr <= MEMORY_GOAL,
            unit="MiB",
        ),
        row(
            f"logprobs fwd+bwd time: full vs chunked ({tag})",
            full["seconds"],
            chunked["seconds"],
            chunked["seconds"] / full["seconds"],
            "(report)",
            None,
            unit="s",
        ),
    ]
    if "chunked_1024" in mem:
        c2 = mem["chunked_1024"]
        rows.append(
            row(
                f"logprobs peak RSS over inputs: full vs chunked, chunk_size 1024 (default {chunked['chunk_size']})",
                full["peak_over_inputs"] / 2**20,
                c2["peak_over_inputs"] / 2**20,
                c2["peak_over_inputs"] / max(full["peak_over_inputs"], 1),
                "(report)",
                None,
                unit="MiB",
                seconds=c2["seconds"],
            )
        )
    return finish(
        NAME, quick, results, t_start, [(f"training throughput and memory ({'quick' if quick else 'full'})", rows)]
    )


def main(argv=None) -> int:
    p = arg_parser(__doc__, "smaller model, batch and vocabulary, one round (< 20 s)")
    p.add_argument("--memory-child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        method, vocab, hidden, n, repeats, chunk = args.memory_child
        print(
            json.dumps(memory_child(method, int(vocab), int(hidden), int(n), int(repeats), int(chunk) or None)),
            flush=True,
        )
        return 0
    res = run(quick=args.quick, wait_quiet=args.wait_quiet)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
