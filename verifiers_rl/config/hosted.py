"""verifiers' Hosted Training configs (`configs/rl/*.toml`: the files users submit to Prime's hosted training), run
locally as written: what has a meaning here is moved onto our keys, what has none is named once.

    model, max_steps, batch_size, rollouts_per_example, ...  -> model, [trainer.args] (same names)
    [sampling] max_tokens, temperature, top_p, ...           -> [trainer.args] (RLConfig's sampling fields;
                                                                max_seq_len = max_tokens + 2048 of prompt)
    [[env]] id, args (+ [buffer] env_ratios)                 -> [[env]] id, args, ratio
    [wandb] project, name, entity, tags, group, ...          -> [trainer.args.wandb] (wandb.init's arguments)
    [buffer] online_difficulty_filtering, seed               -> [trainer.args]
    [eval] interval, num_examples, rollouts_per_example,     -> [trainer.args] eval_strategy/eval_steps, [eval]
           eval_base_model                                      num_examples / rollouts_per_example / before

Everything else (the buffer's easy/hard thresholds, [val], [[eval.env]], an environment's harness/taskset, unknown
keys) is listed in one line on stderr, once per command (the trainer processes vf-rl starts do not repeat it).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from verifiers_rl.errors import ConfigError

# top-level keys of a hosted config that are RLConfig fields of the same name and meaning
TOP_LEVEL = (
    "max_steps",
    "batch_size",
    "rollouts_per_example",
    "oversampling_factor",
    "max_async_level",
    "learning_rate",
    "lora_alpha",
    "lora_rank",
    "seed",
)
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SAMPLING += ("presence_penalty", "frequency_penalty")
HOSTED_SECTIONS = ("sampling", "buffer", "val", "wandb")
NOTED = "VF_RL_HOSTED_NOTED"  # set once the ignored keys were named: the trainer processes inherit it


def is_hosted(cfg: dict[str, Any]) -> bool:
    """A Hosted Training config: its top-level training keys or tables (ours keeps those in [trainer.args])."""
    return any(k in cfg for k in (*TOP_LEVEL, *HOSTED_SECTIONS))


def from_hosted(cfg: dict[str, Any], our_keys: set[str], cli: frozenset[str] = frozenset()) -> list[str]:
    """Rewrite a hosted config in place into ours; returns the keys that mean nothing here (also printed). A config
    that is not one is left as it is. `our_keys`: our own top-level keys and sections ([trainer], ...), which stay."""
    if not is_hosted(cfg):
        return []
    args: dict[str, Any] = {}
    ignored: list[str] = []
    ours = our_keys - set(TOP_LEVEL)
    for key in [k for k in cfg if k not in ours and k not in HOSTED_SECTIONS]:
        value = cfg.pop(key)
        if key in TOP_LEVEL:
            args[key] = value
        else:
            ignored.append(key)
    _sampling(cfg.pop("sampling", {}), args, ignored)
    _wandb(cfg.pop("wandb", {}), args, ignored)
    ratios = _buffer(cfg.pop("buffer", {}), args, ignored)
    if "val" in cfg:
        cfg.pop("val")
        ignored.append("[val]")
    _eval(cfg, args, ignored)
    cfg["env"] = _envs(cfg.get("env", []), ratios, ignored)
    _merge(cfg, args, cli)
    _note(ignored)
    return ignored


def _merge(cfg: dict[str, Any], mapped: dict[str, Any], cli: frozenset[str]) -> None:
    """The mapped keys into [trainer.args]; a value also given there (`--trainer.args.max_steps 2`) wins when it
    came from the command line, and two values in the file are one setting too many."""
    args = cfg.setdefault("trainer", {}).setdefault("args", {})
    for key, value in mapped.items():
        if key in args and args[key] != value:
            if f"trainer.args.{key}" in cli:
                continue
            raise ConfigError(f"{key}={value!r} and trainer.args.{key}={args[key]!r} are one setting: keep one")
        args[key] = value


PROMPT_ROOM = 2048  # tokens of prompt a hosted config's context holds besides [sampling] max_tokens


def _sampling(section: dict, args: dict, ignored: list[str]) -> None:
    """[sampling] onto RLConfig's sampling fields. A hosted config states no context length (the platform picks
    it): ours is max_tokens plus room for a prompt, so that a config with long completions plans as written."""
    for key, value in section.items():
        if key in SAMPLING:
            args[key] = value
        else:
            ignored.append(f"sampling.{key}")
    if isinstance(section.get("max_tokens"), int):
        args["max_seq_len"] = section["max_tokens"] + PROMPT_ROOM


def _wandb(section: dict, args: dict, ignored: list[str]) -> None:
    from verifiers_rl.config.checks import WANDB_KEYS

    kept = {k: v for k, v in section.items() if k in WANDB_KEYS}
    ignored += [f"wandb.{k}" for k in section if k not in WANDB_KEYS]
    if kept:
        args["wandb"] = kept


def _buffer(section: dict, args: dict, ignored: list[str]) -> list | None:
    for key in ("online_difficulty_filtering", "seed"):
        if key in section:
            args[key] = section[key]
    ignored += [f"buffer.{k}" for k in section if k not in ("online_difficulty_filtering", "seed", "env_ratios")]
    return section.get("env_ratios")


def _eval(cfg: dict, args: dict, ignored: list[str]) -> None:
    """Hosted [eval] evaluates every `interval` steps: our eval_strategy "steps"; the base model evaluated first is
    our `before` (a hosted run has no warm-start: the base model is the one RL starts from)."""
    section = cfg.pop("eval", None)
    if section is None:
        return
    ours: dict[str, Any] = {}
    for key, value in section.items():
        if key in ("before", "after", "base", "greedy", "temperature"):  # our own [eval] keys: as they are
            ours[key] = value
        elif key == "interval":
            args["eval_strategy"], args["eval_steps"] = "steps", value
        elif key in ("num_examples", "rollouts_per_example"):
            ours[key] = value
        elif key == "eval_base_model":
            ours["before"] = value
        elif key == "env":
            ignored.append("[[eval.env]] (eval runs on the training environments)")
        else:
            ignored.append(f"eval.{key}")
    cfg["eval"] = ours


def _envs(entries, ratios: list | None, ignored: list[str]) -> list[dict] | dict:
    entries = entries if isinstance(entries, list) else [entries]
    if ratios is not None and (not isinstance(ratios, list) or len(ratios) != len(entries)):
        raise ConfigError(f"buffer.env_ratios={ratios!r}: one ratio per [[env]] table ({len(entries)})")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"env[{i}]={entry!r}: each [[env]] is a table with an id")
        kept = {k: v for k, v in entry.items() if k in ("id", "args", "ratio")}
        ignored += [f"env[{i}].{k}" for k in entry if k not in kept]
        if ratios is not None:
            kept["ratio"] = ratios[i]
        out.append(kept)
    return out


def _note(ignored: list[str]) -> None:
    if ignored and not os.environ.get(NOTED):
        print(
            f"note: a Hosted Training config; these keys mean nothing to a local run and are ignored: "
            f"{', '.join(ignored)}",
            file=sys.stderr,
            flush=True,
        )
        os.environ[NOTED] = "1"
