"""Generate docs/configuration.md from RLConfig and the run file's sections:
`python -m verifiers_rl.scripts.config_docs`.

tests/unit/test_docs.py regenerates it and fails when the committed file differs, so docs never drift from code."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from transformers import TrainingArguments

HEADER = """# Configuration reference

Generated from the code by `python -m verifiers_rl.scripts.config_docs` — do not edit by hand
(`tests/unit/test_docs.py` fails when this file and the code disagree).

## TOML files (`vf-rl`, `vf-train`, `vf-sft`)

```toml
model = "Qwen/Qwen3-0.6B"      # hub id, local folder, or "tiny" (the offline tiny model, see [tiny])
output_dir = "../../runs/my-run"  # optional, relative to this file; default <workspace>/outputs/<run_name>
run_name = "my-run"             # optional

[env]
id = "reverse-text"             # vf.load_environment(id, **args)
[env.args]                      # keyword arguments of the environment's load_environment

# or several environments in one run: one [[env]] table each (instead of [env]); each batch mixes them by ratio
# [[env]]
# id = "reverse-text"
# ratio = 2                     # optional, default 1: drawn twice as often as a ratio-1 environment
# [env.args]                    # this environment's own arguments
# num_train_examples = 500
# [[env]]
# id = "alphabet-sort"

[inference]
gpus = 1                        # CUDA devices for the server (assigned first)
engine = "auto"                 # = server_engine: auto (vLLM with CUDA, else CPU engine) | cpu | vllm
host = "127.0.0.1"              # = vllm_server_host
port = 8000                     # = vllm_server_port; optional; default: a free port
startup_timeout = 600           # = vllm_server_timeout
[inference.args]                # = server_args: vLLM flags (gpu_memory_utilization = 0.8: --gpu-memory-utilization 0.8)

[trainer]
gpus = 1                        # CUDA devices for the trainer (after the server's); > 1 runs accelerate
accelerate_config = "configs/accelerate/zero3.yaml"  # optional: ZeRO-3 or FSDP2 (fsdp_version 2); see docs/scaling.md
[trainer.args]                  # RLConfig fields (below); vf-sft: SFTConfig fields + use_lora, lora_rank, ...
[trainer.args.wandb]            # wandb.init's settings; reports to wandb
project = "reverse-text-tutorial"
name = "my-first-run"

[sft]                           # ours: warm-start with this vf-sft config first (skipped when done)
config = "configs/vf-sft/reverse-text.toml"

[tiny]                          # ours: model = "tiny"
hidden = 64
layers = 2
seed = 0

[eval]                          # ours: held-out eval reward around RL (vf-rl)
before = true
after = true
num_examples = 64
rollouts_per_example = 1

[dataset]                       # vf-sft: one of env / path / name
env = "reverse-text"
completion_template = "<reversed_text>\n{answer}\n</reversed_text>"
```

**Paths.** A path a config names (`output_dir`, `[sft] config`, `[dataset] path`, a `./model` folder,
`[trainer] accelerate_config`) is relative to the config file's folder. What a config does not name goes to its
workspace's `outputs/`: the folder that holds the `configs/` folder the file is in (the layout `vf-rl setup` makes),
or the file's own folder: `outputs/<run_name>` (the run), `outputs/sft-<config name>` (a warm-start),
`outputs/tiny-models`. Neither depends on the directory the command runs from, so `vf-rl @ /abs/path/cfg.toml`
finds the same warm-start and resumes the same run from anywhere; `--dry-run` prints the absolute paths. A
relative path that exists only in the current directory is named in one line, not read from there.

Override any key from the command line: `vf-rl @ cfg.toml --trainer.args.learning_rate 1e-4 --env.args.max_len 12`.
Unknown sections or keys, wrong types and invalid values stop the command with one line naming the key.

**In an editor.** `verifiers_rl/config/run_file.schema.json` is the JSON schema of a `vf-rl` / `vf-train` file,
generated from the code that checks it (the run file's sections and every RLConfig field, with its default and
meaning; `python -m verifiers_rl.config.run_file` writes it). A TOML extension that reads JSON schemas (Taplo,
VS Code's Even Better TOML) completes and checks keys with it: put `#:schema <path to run_file.schema.json>` on the
file's first line (`python -c "import verifiers_rl.config.schema as s; print(s.SCHEMA_FILE)"` prints the path).

**One setting, one home.** `[inference] host`, `port`, `startup_timeout`, `engine` and `args` are the TOML spelling
of RLConfig fields (the "also in TOML as" column below), as upstream `vf-rl` wrote them: a run reads one value, in
`vf-rl`, `vf-train` and `RLConfig(...)` alike. Both spellings with different values stop with one line naming both
keys; a command-line override wins over the file's other spelling. Upstream's `[trainer] run_name` is the
top-level `run_name`.

**Several environments.** `[[env]]` tables (`id`, `args`, `ratio`) train on one `vf.EnvGroup`: prompts are drawn by
ratio (each batch holds each environment's share to within a prompt or two), each environment from its own seeded
order; metrics add `reward/<name>` and `rollouts/<name>` per environment (name: the id's last part), and eval runs
`[eval] num_examples` of each. Errors name the entry: `env[1].ratio=-1: ...`, `env[1]: environment 'x' is not
installed ...`.

**Hosted Training configs.** verifiers' `configs/rl/*.toml` (top-level `max_steps`, `batch_size`, ...; `[sampling]`,
`[[env]]`, `[wandb]`, `[buffer]`, `[eval]`) run as written: top-level training keys and `[sampling]` go to
`[trainer.args]` (`max_seq_len` = `max_tokens` + 2048 of prompt), `[wandb]` to `[trainer.args.wandb]`, `[buffer]
online_difficulty_filtering`/`seed` to `[trainer.args]` and `env_ratios` to the `[[env]]` ratios, `[eval] interval`
to `eval_strategy = "steps"`/`eval_steps` (`eval_base_model` is `[eval] before`). Keys with no local meaning are
named in one line (`note: a Hosted Training config; these keys mean nothing to a local run ...`).

"""


def _type_name(f) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("|", "\\|")


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "required"


def render() -> str:
    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.config.run_file import toml_keys

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    lines = [HEADER, "## TOML keys by section\n", "| section | keys |", "|---|---|"]
    for section, keys in toml_keys().items():
        lines.append(f"| `{section or 'top level'}` | {', '.join(f'`{k}`' for k in keys)} |")
    lines += [
        "",
        "## RLConfig (`[trainer.args]`)",
        "",
        "Fields RLConfig adds to `transformers.TrainingArguments`, and the TrainingArguments defaults it changes.",
        "",
        "| field | also in TOML as | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(RLConfig):
        own = f.name not in inherited or f.name in RLConfig.__dict__.get("__annotations__", {})
        if not own:
            continue
        help_text = f.metadata.get("help", "").replace("|", "\\|").replace("\n", " ")
        alias = f"`[{f.metadata['toml'].replace('.', '] ')}`" if f.metadata.get("toml") else ""
        lines.append(f"| `{f.name}` | {alias} | `{_type_name(f)}` | `{_default(f)}` | {help_text} |")
    lines += [
        "",
        "Every other `TrainingArguments` field (e.g. `activation_checkpointing`, `bf16`, `seed`, `eval_strategy`,",
        "`eval_steps`, `save_total_limit`) works as in transformers.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/configuration.md")
    out.write_text(render())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
