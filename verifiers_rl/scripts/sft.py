"""`vf-sft @ cfg.toml`: SFT warm-start on TRL's SFTTrainer (LoRA or full), writing a checkpoint that an RL
config can use as `model` (or reference through its `[sft] config`).

    model = "Qwen/Qwen3-0.6B"                  # or a local path, or "tiny"
    [dataset]
    env = "reverse-text"                       # prompt -> answer pairs from an environment's dataset ([env.args])
    completion_template = "<reversed_text>\n{answer}\n</reversed_text>"   # formats each row's answer
    # multi-turn: replies = "alphabet_sort:reference_replies" (info -> every turn's reference reply); the
    # environment runs its own turns around them and each assistant turn becomes one sample (sft_transcripts.py)
    # or: path = "data.jsonl" (prompt/completion or messages rows), or name = "<hub dataset>" + split
    [trainer.args]                             # SFTConfig fields, plus use_lora / lora_rank / lora_alpha
    learning_rate = 2e-4

The final model (LoRA merged into the base) goes to <output_dir>/final.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

from verifiers_rl.config.lora import LORA_ALPHA, LORA_DROPOUT, LORA_RANK, lora_config, quiet_peft_wrap
from verifiers_rl.config.reporting import wandb_login_problem
from verifiers_rl.config.run_file import RunFile
from verifiers_rl.config.toml import ConfigError, suggest
from verifiers_rl.scripts.common import resolve_model, run_cli, split_argv

LORA_KEYS = {
    "use_lora": False,
    "lora_rank": LORA_RANK,
    "lora_alpha": LORA_ALPHA,
    "lora_dropout": LORA_DROPOUT,
    "lora_target_modules": None,  # DEFAULT_LORA_TARGETS
}
SFT_DEFAULTS = {
    "learning_rate": 2e-4,
    "num_train_epochs": 1,
    "per_device_train_batch_size": 8,
    "logging_steps": 10,
    "save_strategy": "no",
    "report_to": "none",
    "max_length": 1024,
    "completion_only_loss": True,
}


@dataclasses.dataclass
class SftPlan:
    """An RL config's [sft] warm-start: its run file, where its model goes, and whether it is there already."""

    file: RunFile
    final_dir: str
    done: bool
    config_path = property(lambda self: self.file.path)


def sft_plan(sft: RunFile) -> SftPlan:
    final = sft_output_dir(sft) / "final"
    return SftPlan(sft, str(final), (final / "config.json").exists())


def sft_output_dir(run: RunFile) -> Path:
    named = run.trainer.args.get("output_dir") or run.output_dir
    return Path(run.output_dir_for(named, f"sft-{Path(run.path).stem}"))


def sft_args(run: RunFile):
    from trl import SFTConfig

    given = dict(run.trainer.args)
    lora = {k: given.pop(k, v) for k, v in LORA_KEYS.items()}
    wandb = given.pop("wandb", None)
    if wandb:  # [trainer.args.wandb] (or [wandb]), as vf-rl takes it: transformers' wandb callback reads env vars
        given.setdefault("report_to", "wandb")
        if wandb.get("name"):
            given.setdefault("run_name", wandb["name"])
    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    for key in given:
        if key not in fields:
            raise ConfigError(
                f"unknown key 'trainer.args.{key}'{suggest(key, fields | set(LORA_KEYS))}; vf-sft takes "
                "SFTConfig fields plus use_lora, lora_rank, lora_alpha, lora_dropout, lora_target_modules"
            )
    import torch

    kwargs = {**SFT_DEFAULTS, "output_dir": str(sft_output_dir(run)), **given}
    # TRL turns checkpointing on by default under transformers' old name, which warns (FutureWarning): the same
    # default, and a user's gradient_checkpointing, under the new name
    old_name = kwargs.pop("gradient_checkpointing", None)
    if kwargs.get("activation_checkpointing") is None:
        kwargs["activation_checkpointing"] = True if old_name is None else old_name
    if not torch.cuda.is_available():
        kwargs.update(use_cpu=True, bf16=False, fp16=False)
    try:
        args = SFTConfig(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[trainer.args] {e}") from None
    args.wandb = wandb_settings(wandb or {})
    if problem := wandb_login_problem(args):  # before the model loads, and in the dry run
        raise ConfigError(problem)
    if torch.cuda.is_available():
        one_device(args)
    return args, lora


# [trainer.args.wandb] keys as the environment variables wandb.init reads (transformers' callback passes no more
# than the project and run name)
WANDB_ENV = {
    "project": "WANDB_PROJECT",
    "entity": "WANDB_ENTITY",
    "tags": "WANDB_TAGS",
    "group": "WANDB_RUN_GROUP",
    "notes": "WANDB_NOTES",
    "job_type": "WANDB_JOB_TYPE",
    "mode": "WANDB_MODE",
    "dir": "WANDB_DIR",
}


def wandb_settings(table: dict[str, Any]) -> dict[str, Any]:
    from verifiers_rl.config.checks import WANDB_KEYS

    unknown = sorted(set(table) - set(WANDB_KEYS))
    if unknown:
        raise ConfigError(f"trainer.args.wandb: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(WANDB_KEYS)}")
    return table


def wandb_environment(table: dict[str, Any]) -> None:
    for key, var in WANDB_ENV.items():
        if key in table:
            value = table[key]
            os.environ[var] = ",".join(map(str, value)) if isinstance(value, list) else str(value)


def one_device(args) -> None:
    """Train on one GPU when this process is not one rank of a distributed launch. transformers sets `n_gpu` to
    every visible GPU then, and Trainer wraps the model in nn.DataParallel over all of them: a replica per GPU
    each step, a server's GPU too when they are visible (issue 54). Data parallel SFT is a launcher's job
    (`accelerate launch`), where each rank sees n_gpu == 1 and this does nothing."""
    from transformers.training_args import ParallelMode

    if args.parallel_mode == ParallelMode.NOT_DISTRIBUTED and args.n_gpu > 1:
        print(
            f"vf-sft: {args.n_gpu} GPUs visible; training on {args.device} only (one process; "
            "CUDA_VISIBLE_DEVICES chooses the GPU)",
            flush=True,
        )
        args._n_gpu = 1  # what Trainer reads to decide on DataParallel (it does the same for model parallel)


def sft_dataset(run: RunFile):
    """Rows of {"prompt": messages, "completion": [assistant message]} (or the dataset as given)."""
    from datasets import load_dataset

    from verifiers_rl.config.run_file import Dataset

    source = run.dataset or Dataset()
    if source.env:
        from verifiers_rl.scripts.environments import load_environment

        env = load_environment(source.env, run.env[0].args if run.env else {})
        rows = env.get_dataset()
        if source.replies:  # multi-turn: transcripts from the environment's own turns
            return _transcripts(env, rows, source)
        template, field = source.completion_template, source.completion_field

        def to_pair(row):
            try:
                text = template.format(**row)
            except KeyError as e:
                raise ConfigError(f"dataset.completion_template uses {e} which the rows do not have") from None
            return {"prompt": row["prompt"], "completion": [{"role": "assistant", "content": text or str(row[field])}]}

        ds = rows.map(to_pair, remove_columns=rows.column_names)
    elif source.path:
        path = run.resolve(source.path)
        if not Path(path).exists():
            raise ConfigError(f"dataset.path {path!r} does not exist")
        kind = "json" if path.endswith((".json", ".jsonl")) else Path(path).suffix.lstrip(".")
        ds = load_dataset(kind, data_files=path, split="train")
    elif source.name:
        ds = load_dataset(source.name, split=source.split)
    else:
        raise ConfigError("[dataset] needs one of: env, path, name")
    n = source.num_examples
    return ds.select(range(min(n, len(ds)))) if n else ds


def _transcripts(env, rows, source):
    from datasets import Dataset

    from verifiers_rl.scripts.sft_transcripts import load_replies, transcript_samples

    n = source.num_examples
    rows = rows.select(range(min(n, len(rows)))) if n else rows
    samples, reward = transcript_samples(env, rows, load_replies(source.replies))
    print(
        f"vf-sft: {len(samples)} turns from {len(rows)} reference transcripts of {source.env} "
        f"(their mean reward: {reward:.3f})",
        flush=True,
    )
    return Dataset.from_list(samples)


def sft_command(config_path: str) -> list[str]:
    """`vf-sft @ config` as `vf-rl` runs its warm-start: this interpreter, the config by absolute path."""
    return [sys.executable, "-m", "verifiers_rl.scripts.sft", "@", str(Path(config_path).resolve())]


def sft_devices(visible_devices: str) -> str:
    """The trainer's first GPU: the warm-start is one process on one GPU. Given all of the trainer's GPUs, one
    process would wrap the model in nn.DataParallel over them (issue 54); under the trainer's launcher each rank
    would write final/. "" (a CPU) stays "". A model that needs several GPUs to train is out of its reach."""
    return visible_devices.split(",")[0]


def sft_line(config_path: str, visible_devices: str) -> str:
    """The warm-start's command line as `vf-rl --dry-run` prints it and `run_sft_process` runs it, on the first
    of `visible_devices` (`sft_devices`)."""
    return f"CUDA_VISIBLE_DEVICES={sft_devices(visible_devices)} {shlex.join(sft_command(config_path))}"


def run_sft_process(config_path: str, visible_devices: str) -> None:
    """`vf-rl`'s SFT warm-start, in a process of its own that sees only the first of `visible_devices` (the
    trainer's GPUs; "" on a CPU; `sft_devices`). In vf-rl's own process, Trainer would wrap the model in
    DataParallel over every visible GPU, the server's too, and the CUDA context and cached memory would stay for
    the whole run; a child's end frees them.
    Its output goes to the terminal as it comes; a failure is one line naming its exit code and command."""
    from verifiers_rl.errors import TrainingError
    from verifiers_rl.serving.launcher import _die_with_parent

    cmd, line = sft_command(config_path), sft_line(config_path, visible_devices)
    print(f"vf-rl: SFT warm-start: {line}", flush=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": sft_devices(visible_devices)}
    # an exception here (Ctrl-C) kills it (subprocess.run); vf-rl killed outright takes it along (the kernel's
    # parent-death signal, as for the server)
    code = subprocess.run(cmd, env=env, preexec_fn=_die_with_parent).returncode
    if code != 0:
        raise TrainingError(f"the SFT warm-start failed (exit code {code}; its output is above): {line}")


def run_sft(run: RunFile) -> str:
    from verifiers_rl.models import get_model_and_tokenizer

    args, lora = sft_args(run)
    wandb_environment(args.wandb)
    dataset = sft_dataset(run)
    model, tokenizer = get_model_and_tokenizer(resolve_model(run))
    use_cache = model.config.use_cache  # Trainer sets it False for training; final/ keeps the base model's
    peft_config = None
    if lora["use_lora"]:
        peft_config = lora_config(
            lora["lora_rank"], lora["lora_alpha"], lora["lora_dropout"], lora["lora_target_modules"]
        )
    print(f"vf-sft: {len(dataset)} examples -> {args.output_dir}", flush=True)
    from verifiers_rl.scripts.sft_loss import ChunkedSFTTrainer  # TRL's, with the loss taken chunk by chunk

    with quiet_peft_wrap():  # TRL wraps the model with peft itself
        trainer = ChunkedSFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
        )
    trainer.train()
    final = Path(args.output_dir) / "final"
    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    from verifiers_rl.export.checkpoints import staged

    model.config.use_cache = use_cache
    with staged(final) as tmp:  # `final/config.json` marks the warm-start done: it appears with the weights
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    print(f"vf-sft: wrote {final} (use it as `model` in an RL config)", flush=True)
    return str(final)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point. It raises SystemExit(code) itself: verifiers' own `vf-*` scripts call `main()`
    and drop its return value, and whichever package was installed last owns the script name."""
    raise SystemExit(run_command(argv))


def run_command(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        path, overrides, flags = split_argv(argv, "vf-sft")
        run = RunFile.read(path, overrides, "vf-sft")
        if "--dry-run" in flags:
            args, lora = sft_args(run)
            source = run.dataset.model_dump(exclude_unset=True) if run.dataset else None
            print(f"vf-sft: {run.model} on {source} (lora={lora['use_lora']}) -> {args.output_dir}/final")
            return 0
        run_sft(run)
        return 0

    return run_cli("vf-sft", body)


if __name__ == "__main__":
    main()
