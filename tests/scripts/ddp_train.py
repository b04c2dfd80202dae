"""Run by tests/e2e/test_ddp.py, once plainly and once under `accelerate launch --num_processes 2 --cpu`."""

import json
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from rl_envs import reverse_env  # noqa: E402

from verifiers_rl.rl.trainer import RLConfig, RLTrainer  # noqa: E402

model_dir, out = sys.argv[1], sys.argv[2]
args = RLConfig(
    output_dir=out,
    rollouts_per_example=4,
    batch_size=16,
    micro_batch_size=4,
    max_steps=2,
    max_tokens=6,
    max_seq_len=96,
    max_prompt_len=64,
    learning_rate=5e-3,
    lora_rank=4,
    lora_alpha=8,
    use_cpu=True,
    seed=3,
    save_strategy="no",
    max_async_level=0,
    log_completions=False,
    server_mode="spawn",  # its own server, whatever listens on port 8000
)
trainer = RLTrainer(model=model_dir, env=reverse_env(), args=args)
try:
    trainer.train()
    metrics = trainer.evaluate()  # rank 0 talks to the server; every rank gets the same numbers
    has_server = trainer.runtime.client is not None
    rank = trainer.accelerator.process_index
    # a file per rank: two ranks printing to one pipe can interleave their lines
    with open(f"{out}/eval-rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "reward": round(metrics["eval/reward"], 6), "has_server": has_server}, f)
finally:
    trainer.close()
if trainer.is_world_process_zero():
    lora = {
        n: p.detach().cpu()
        for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
        if "lora_" in n
    }
    torch.save(lora, f"{out}/lora.pt")
    print("WORLD", trainer.accelerator.num_processes)
