"""Run by tests/e2e/test_ddp.py, once plainly and once under `accelerate launch --num_processes 2 --cpu`."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl_envs import reverse_env  # noqa: E402
from runs import tiny_rl_config  # noqa: E402

from verifiers_rl.trainer import RLTrainer  # noqa: E402

model_dir, out = sys.argv[1], sys.argv[2]
# test_sync_verify's geometry: micro-batches of 4, on-policy
args = tiny_rl_config(Path(out), output_dir=out, micro_batch_size=4, seed=3, max_async_level=0)
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
