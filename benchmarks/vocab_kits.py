"""The two tiny kits side by side: one trainer logprob step and one merged-weight sync's payload at 261 ids (byte
kit) and at Qwen3's 151,936 rows (Qwen kit), same geometry otherwise (hidden 64, 2 layers, head_dim 32, LoRA r4).

Timed: forward to the final hidden states + `logprobs.chunked_logprobs` at the trained positions + backward, on
16 sequences x 128 tokens, median of 7 after 2 warm-ups; each kit in a child process, whose peak RSS (VmHWM) minus
its RSS before the first step is the step's memory. Sync payload: the bytes of the merged weights a LoRA sync
sends (every tensor of the model, LoRA merged). A quick measurement, not part of run.py:

    .venv/bin/python benchmarks/vocab_kits.py    # writes results/vocab_kits.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "vocab_kits.json"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(kit: str) -> dict:
    import torch

    from verifiers_rl.config.lora import lora_config, wrap_lora
    from verifiers_rl.loss.logprobs import chunked_logprobs
    from verifiers_rl.sync.policy_weights import merged_weights

    torch.set_num_threads(2)
    if kit == "qwen":
        from verifiers_rl.tiny.qwen import build_qwen_model as build
    else:
        from verifiers_rl.tiny import build_tiny_model as build
    model, tok = build()
    model = wrap_lora(model, lora_config(4, 8))
    model.train()
    vocab = model.get_base_model().lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (16, 128), generator=g)
    head = model.get_base_model().lm_head

    def step() -> float:
        t0 = time.perf_counter()
        hidden = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states[-1]
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        logp, _ = chunked_logprobs(h, head.weight, ids[:, 1:].reshape(-1), with_entropy=False)
        (-logp.mean()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    rss_before = _status_kib("VmRSS")
    for _ in range(2):
        step()
    times = [step() for _ in range(7)]
    payload = sum(t.numel() * t.element_size() for _, t in merged_weights(model))
    return {
        "kit": kit,
        "vocab_rows": vocab,
        "tokenizer_ids": len(tok),
        "step_s_median": statistics.median(times),
        "step_s_all": times,
        "step_peak_rss_over_start_mib": (_status_kib("VmHWM") - rss_before) / 1024,
        "merged_sync_payload_mib": payload / 2**20,
    }


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(child(sys.argv[1])))
        return
    rows = []
    for kit in ("bytes", "qwen"):
        out = subprocess.run([sys.executable, __file__, kit], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {
        "what": __doc__.split("\n\n")[0],
        "shape": "16 x 128 tokens, hidden 64, 2 layers, LoRA r4, float32, 2 threads",
        "loadavg_1m_at_end": os.getloadavg()[0],
        "kits": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
