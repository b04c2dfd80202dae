"""Time to reward: TRL's GRPOTrainer vs ours from the same warm-start, judged by one held-out evaluator.

    .venv/bin/python benchmarks/bench_reward_time.py [--quick]

Both trainers start from the reverse-text demo's SFT checkpoint (`configs/vf-sft/tiny-reverse-text.toml`, built
once by `vf-sft` and cached in $VF_BENCH_CACHE; not timed) and train with the demo's RL settings: 8 prompts x 8
rollouts per step, 48 completion tokens, temperature 1.4, LoRA r16 / alpha 32 on every projection plus the RMSNorm
weights (peft modules_to_save), learning rate 1e-3 constant, AdamW, grad clip 1.0, the "dapo" loss (token-level
PPO clip 0.2 / 0.28) with group-std advantages, no KL, the same reward (the environment's `score_reversal`), the
same data and LoRA init. TRL trains the step's 64 samples in one padded batch; ours packs them (micro_batch_size
64). Ours runs with its default max_async_level = 1 (each batch sampled at most one step behind).

Evaluator (one function, both runs): every `every` steps a callback copies the trainable tensors (LoRA factors and
norms, a few hundred kB, well under a millisecond) with the wall time since `train()` was called. After training,
each snapshot is loaded into the run's own model and scored by HF `generate` on the same held-out prompts at the
training temperature, one sample per prompt, each prompt with its own fixed seed (the same seeds for every
snapshot of both runs, so the curves differ by the weights, not by the draws). Evaluation time is not in any clock.

Both clocks start when `train()` is called, so ours includes starting its inference server (TRL generates in
its own process and has none to start).

Reported: both curves (eval reward against wall seconds) in results/bench_reward_time.png; TRL's final eval reward
(the mean of its last two evaluations, to damp sampling noise) as the target; the first time ours' eval reaches it
over TRL's whole wall time (goal <= 0.4); s/step of each; greedy eval of the final weights.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import RESULTS_DIR, finish, left_padded_prompts, main_for, row, wait_for_quiet  # noqa: E402
from bench_async import make_clock, rl_config, run_rl, window_stats  # noqa: E402

NAME = "bench_reward_time"
GOAL = 0.4  # ours' time to TRL's final eval reward / TRL's wall time
DEMO_SFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "vf-sft", "tiny-reverse-text.toml")


def settings(quick: bool) -> dict:
    base = dict(prompts=8, group=8, max_tokens=48, lr=1e-3, temperature=1.4, rank=16, alpha=32)
    if quick:
        return {**base, "prompts": 2, "group": 4, "max_tokens": 16, "steps": 4, "every": 2, "eval_n": 8}
    return {**base, "steps": 200, "every": 20, "eval_n": 200}


def warm_start(log, quick: bool = False) -> tuple[str, list[dict], list[dict], object]:
    """The demo's SFT checkpoint (vf-sft, cached) and the environment exactly as the demo configures it; --quick
    stops the SFT after 4 steps (it only checks that the benchmark runs)."""
    import hashlib

    from verifiers_rl.config.run_file import RunFile
    from verifiers_rl.scripts.environments import load_environment
    from verifiers_rl.scripts.sft import run_sft

    key = hashlib.sha1(open(DEMO_SFT, "rb").read()).hexdigest()[:12] + ("-quick" if quick else "")
    out = os.path.join(os.environ.get("VF_BENCH_CACHE", "/tmp/vf_rl_bench_cache"), f"demo-sft-{key}")
    final = os.path.join(out, "final")
    overrides = ["--trainer.args.output_dir", out] + (["--trainer.args.max_steps", "4"] if quick else [])
    sft = RunFile.read(os.path.abspath(DEMO_SFT), overrides, "vf-sft")
    if not os.path.exists(os.path.join(final, "config.json")):
        cwd = os.getcwd()
        os.makedirs(out, exist_ok=True)
        os.chdir(out)  # vf-sft builds the tiny model and writes outputs/ relative to the working directory
        try:
            t0 = time.perf_counter()
            run_sft(sft)
            log(f"warm-start: vf-sft in {time.perf_counter() - t0:.0f}s -> {final}")
        finally:
            os.chdir(cwd)
    env = load_environment("reverse-text", sft.env[0].args if sft.env else {})
    return final, [dict(r) for r in env.get_dataset()], [dict(r) for r in env.get_eval_dataset()], env


def make_snapshots(every: int, last: int):
    """A TrainerCallback keeping (step, perf_counter time, trainable tensors) at train begin and every `every`
    steps; times become seconds since `train()` was called once the run says when that was."""
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.items: list[tuple[int, float, dict]] = []

        def take(self, step: int, model) -> None:
            t = time.perf_counter()
            weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            self.items.append((step, t, weights))

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.take(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0 or state.global_step == last:
                self.take(state.global_step, model)

    return Snapshots()


@torch.no_grad()
def evaluate(model, tok, rows, s: dict, greedy: bool = False, batch: int = 50) -> float:
    """Mean score_reversal of one completion per prompt (HF generate; prompt i always draws with seed i)."""
    import reverse_text

    was = model.training
    model.eval()
    scores = []
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        ids, att, width = left_padded_prompts(tok, part)
        common = dict(max_new_tokens=s["max_tokens"], pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        if greedy:
            out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, **common)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1000 + i)  # the same draws for every snapshot of both runs
                out = model.generate(
                    input_ids=ids, attention_mask=att, do_sample=True, temperature=s["temperature"], top_k=0,
                    top_p=1.0, **common,
                )  # fmt: skip
        texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        scores += [reverse_text.score_reversal(t, r["answer"]) for t, r in zip(texts, part)]
    model.train(was)
    return sum(scores) / len(scores)


def lora_config(s: dict):
    from peft import LoraConfig

    from verifiers_rl.config.rl_config import DEFAULT_LORA_TARGETS

    return LoraConfig(
        r=s["rank"], lora_alpha=s["alpha"], lora_dropout=0.0, target_modules=list(DEFAULT_LORA_TARGETS),
        modules_to_save=["norm"], task_type="CAUSAL_LM",
    )  # fmt: skip


def run_trl(model_dir: str, train_rows, s: dict, out_dir: str, snaps) -> dict:
    import reverse_text
    from transformers import set_seed
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from verifiers_rl.models import get_model, get_tokenizer

    def reward(completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reverse_text.score_reversal(t, a) for t, a in zip(texts, answer)]

    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=s["prompts"] * s["group"], gradient_accumulation_steps=1,
        num_generations=s["group"], max_completion_length=s["max_tokens"], learning_rate=s["lr"],
        lr_scheduler_type="constant", max_grad_norm=1.0, temperature=s["temperature"], top_p=1.0, top_k=0, min_p=None,
        beta=0.0, num_iterations=1, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
        mask_truncated_completions=False, max_steps=s["steps"], use_cpu=True, bf16=False, fp16=False,
        report_to="none", logging_steps=1, save_strategy="no", seed=0, log_completions=False, use_vllm=False,
        disable_tqdm=True, shuffle_dataset=True, warmup_steps=0, weight_decay=0.0,
    )  # fmt: skip
    from datasets import Dataset

    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])
    tok = get_tokenizer(model_dir)
    set_seed(0)  # as RLTrainer does right before get_peft_model: the same LoRA init
    ref: dict = {}
    clock = make_clock(ref)
    trainer = GRPOTrainer(
        model=get_model(model_dir), reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
        peft_config=lora_config(s), callbacks=[clock, snaps],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    t_call = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t_call
    return {"model": trainer.model, "tok": tok, "t_call": t_call, "marks": clock.marks, "total_s": total}


def run_ours(model_dir: str, env, s: dict, out_dir: str, snaps) -> dict:
    from verifiers_rl.models import get_tokenizer

    args = rl_config(
        out_dir, rollouts_per_example=s["group"], batch_size=s["prompts"] * s["group"],
        micro_batch_size=s["prompts"] * s["group"], max_tokens=s["max_tokens"], max_seq_len=128, max_steps=s["steps"],
        learning_rate=s["lr"], lr_scheduler_type="constant", max_grad_norm=1.0, temperature=s["temperature"],
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", kl_beta=0.0, max_async_level=1,
        seed=0, lora_rank=s["rank"], lora_alpha=s["alpha"], lora_dropout=0.0, lora_modules_to_save=["norm"],
        warmup_steps=0, weight_decay=0.0,
    )  # fmt: skip
    kept: dict = {}

    def after(trainer):
        kept["model"] = trainer.model

    res = run_rl(model_dir, env, args, after_train=after, callbacks=[snaps])
    return {
        "model": kept["model"], "tok": get_tokenizer(model_dir), "t_call": res["t_call"], "marks": res["marks"],
        "total_s": res["train_call_s"],
    }  # fmt: skip


def curve(run: dict, snaps, rows, s: dict, log, name: str) -> list[dict]:
    model, tok = run["model"], run["tok"]
    params = dict(model.named_parameters())
    points = []
    for step, t, weights in snaps.items:
        with torch.no_grad():
            for n, w in weights.items():
                params[n].copy_(w)
        points.append({"step": step, "t": t - run["t_call"], "reward": evaluate(model, tok, rows, s)})
        log(f"{name}: step {step} at {points[-1]['t']:.1f}s: eval {points[-1]['reward']:.3f}")
    points[-1]["greedy"] = evaluate(model, tok, rows, s, greedy=True)
    return points


def time_to(points: list[dict], target: float) -> float:
    return next((p["t"] for p in points if p["reward"] >= target), float("inf"))


def plot(curves: dict[str, list[dict]], target: float, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, pts in curves.items():
        ax.plot([p["t"] for p in pts], [p["reward"] for p in pts], "o-" if name == "ours" else "s--", label=name)
    ax.axhline(target, color="#888", lw=1, ls=":", label=f"TRL's final eval reward {target:.3f}")
    ax.set_xlabel("wall seconds since train() was called")
    ax.set_ylabel("held-out eval reward (T sampled, same evaluator)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("reverse-text from the demo's warm-start: TRL GRPOTrainer vs verifiers-rl")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    s = settings(quick)
    results: dict = {"name": NAME, "quick": quick, "settings": s}
    model_dir, train_rows, eval_rows, env = warm_start(log, quick)
    eval_rows = eval_rows[: s["eval_n"]]
    results["machine_before"] = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    runs, curves = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_reward_time_") as tmp:
        for name, fn in (("TRL", run_trl), ("ours", run_ours)):
            snaps = make_snapshots(s["every"], s["steps"])
            src = train_rows if name == "TRL" else env
            runs[name] = r = fn(model_dir, src, s, os.path.join(tmp, name), snaps)
            st = window_stats(r["marks"], 1)
            r["s_per_step"] = st["step_s"]
            log(f"{name}: {s['steps']} steps in {r['total_s']:.1f}s ({st['step_s']:.2f} s/step)")
            curves[name] = curve(r, snaps, eval_rows, s, log, name)
    trl, ours = curves["TRL"], curves["ours"]
    target = sum(p["reward"] for p in trl[-2:]) / len(trl[-2:])
    t_ours = time_to(ours, target)
    ratio = t_ours / runs["TRL"]["total_s"]
    results.update(curves=curves, target=target, time_to_target_s=t_ours)
    results["total_s"] = {k: v["total_s"] for k, v in runs.items()}
    results["plot"] = plot(curves, target, RESULTS_DIR / f"{NAME}{'_quick' if quick else ''}.png")
    rows = [
        row(
            f"time to TRL's final held-out eval reward {target:.3f} (init {trl[0]['reward']:.3f}; "
            f"{s['prompts']}x{s['group']} rollouts, T {s['temperature']}, {s['steps']} steps): TRL's total vs ours",
            runs["TRL"]["total_s"], t_ours, ratio, f"<={GOAL}x" if not quick else "(report)",
            (ratio <= GOAL) if not quick else None, unit="s",
        ),
        row("s/step: TRL vs ours", runs["TRL"]["s_per_step"], runs["ours"]["s_per_step"],
            runs["TRL"]["s_per_step"] / runs["ours"]["s_per_step"], "(report)", None, unit="s"),
        row(f"final held-out eval reward (sampled at T {s['temperature']}): TRL vs ours", trl[-1]["reward"],
            ours[-1]["reward"], None, "(report)", None),
        row("final held-out eval reward (greedy): TRL vs ours", trl[-1]["greedy"], ours[-1]["greedy"], None,
            "(report)", None),
    ]  # fmt: skip
    title = f"time to reward vs TRL ({'quick' if quick else 'full'}; plot {results['plot']})"
    return finish(NAME, quick, results, t_start, [(title, rows)])


def main(argv=None) -> int:
    return main_for(run, __doc__, "4 steps of 2x4 rollouts (checks that it runs)", argv)


if __name__ == "__main__":
    sys.exit(main())
