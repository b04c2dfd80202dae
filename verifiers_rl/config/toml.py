"""The `vf-rl` / `vf-train` / `vf-sft` TOML schema: load, override from the command line, validate.

    model = "Qwen/Qwen3-0.6B"            # hub id, local path, or "tiny" (built offline from [tiny])
    [env]       id = "reverse-text"      # + [env.args] for load_environment(**args); [[env]] + ratio: several
    [inference] gpus = 1                 # + engine, host, port, [inference.args] (vLLM flags)
    [trainer]   gpus = 1                 # + [trainer.args] (RLConfig fields), accelerate_config (ZeRO-3, FSDP2)
    [sft]       config = "configs/vf-sft/x.toml"   # ours: warm-start first (skipped when already done)
    [tiny]      hidden = 64, layers = 2, seed = 0  # ours: the offline tiny model
    [eval]      before = true, after = true        # ours: held-out eval around RL (+ base, greedy, temperature)

Errors name the key and say what is allowed; `ConfigError` carries one line for the CLI to print.
"""

from __future__ import annotations

import datetime
import difflib
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from verifiers_rl.errors import ConfigError

SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "": {"model": str, "output_dir": str, "run_name": str},
    "env": {"id": str, "args": dict, "ratio": (int, float)},  # or [[env]] tables: several environments
    # host, port, startup_timeout and engine are RLConfig fields' TOML spelling (`aliases`), checked as those fields
    # once folded; args is a table here and a list of flags there
    "inference": {"gpus": int, "args": dict},
    "trainer": {"gpus": int, "args": dict, "accelerate_config": str, "run_name": str},
    "sft": {"config": str},
    "tiny": {"hidden": int, "layers": int, "seed": int, "head_dim": int},
    "eval": {
        "before": bool,
        "after": bool,
        "base": bool,
        "greedy": bool,
        "temperature": (int, float),
        "num_examples": int,
        "rollouts_per_example": int,
    },
    "dataset": {
        "env": str,
        "path": str,
        "name": str,
        "split": str,
        "completion_field": str,
        "completion_template": str,
        "replies": str,
        "num_examples": int,
    },  # vf-sft
}
REQUIRED = {
    "vf-rl": [("", "model"), ("env", "id")],
    "vf-train": [("", "model"), ("env", "id")],
    "vf-sft": [("", "model")],
}


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _key(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        where = p.expanduser().absolute()
        raise ConfigError(f"config file {str(path)!r} does not exist (looked for {where}, from {Path.cwd()})")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def resolve_path(value: str, config_path: str | Path) -> str:
    """A path written in a config, relative to that config's folder, wherever the command runs (so
    `vf-rl @ /abs/cfg.toml` works from any directory). A relative path that is not there but is in the current
    directory (the rule before: outputs went there) is named in one line instead of being read from elsewhere."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    folder = Path(config_path).parent  # the folder the config was named from (symlinks are not resolved)
    beside = folder / p
    if not beside.exists() and p.exists() and beside.absolute() != p.absolute():
        raise ConfigError(
            f"{value!r} in {config_path} is not in {folder.absolute()} (a path in a config is relative to the config's "
            f"folder) but in the current directory: write it as {os.path.relpath(p.absolute(), folder.absolute())!r}"
        )
    return str(beside)


def workspace(config_path: str | Path) -> Path:
    """Where what a config does not name goes (`outputs/`): the folder that holds the `configs/` folder the config
    is in (`vf-rl setup`'s layout, this repository's), else the config's own folder. Never the current directory."""
    folder = Path(config_path).absolute().parent
    return next((parent.parent for parent in (folder, *folder.parents) if parent.name == "configs"), folder)


def output_path(named: str | None, default: str, config_path: str | Path | None) -> str:
    """An output folder: the one the config names (relative to the config), else `outputs/<default>` in the
    config's workspace; without a config (Python), relative to the current directory as given."""
    if config_path is None:
        return named or str(Path("outputs") / default)
    if named:
        return str(Path(config_path).parent / Path(named).expanduser()) if not Path(named).is_absolute() else named
    return str(workspace(config_path) / "outputs" / default)


def parse_value(text: str) -> Any:
    """`--trainer.args.learning_rate 1e-4` -> 1e-4; TOML literals (numbers, booleans, arrays), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class Settings(dict):
    """A loaded config; `from_command_line` holds the dotted keys an override set (they win over the file's other
    spelling of the same setting, `fold_aliases`)."""

    from_command_line: frozenset[str] = frozenset()


def apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> Settings:
    """`--section.key value` pairs (or `--section.key=value`) onto the loaded config."""
    cfg, seen = Settings(cfg), set()
    it = iter(overrides)
    for arg in it:
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --trainer.args.learning_rate 1e-4")
        dotted, eq, value = arg[2:].partition("=")
        if not eq:
            value = next(it, None)
            if value is None:
                raise ConfigError(f"override --{dotted} needs a value")
        node = cfg
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{dotted}: {part!r} is not a section")
        node[parts[-1]] = parse_value(value)
        seen.add(dotted)
    cfg.from_command_line = frozenset(seen)
    return cfg


def aliases() -> dict[str, str]:
    """{TOML key outside [trainer.args]: the RLConfig field it spells}, from the fields' own metadata (the
    generated schema), plus upstream's `[trainer] run_name`."""
    from verifiers_rl.config.schema import load_schema

    table = {entry["toml"]: name for name, entry in load_schema().items() if entry.get("toml")}
    return {**table, "trainer.run_name": "run_name"}


def fold_aliases(cfg: dict[str, Any]) -> dict[str, str]:
    """One setting, one home: `[inference] host/port/startup_timeout/engine/args` (upstream vf-rl's spelling) move
    into `[trainer.args]` under their RLConfig names, so vf-rl, vf-train and `RLConfig(...)` read one value. Two
    different values for one setting stop here with one line naming both keys; a command-line override beats the
    file's other spelling. Returns {field: the key the file spelled it with}, for error messages."""
    cli, spelled = getattr(cfg, "from_command_line", frozenset()), {}
    args = cfg.setdefault("trainer", {}).setdefault("args", {})
    for alias, name in aliases().items():
        section, key = alias.split(".")
        if key not in cfg.get(section, {}):
            continue
        value = cfg[section].pop(key)
        if key == "args":  # a table of vLLM flags: RLConfig keeps them as the command line vLLM gets
            value = flags_from_args(value)
        target, home = (cfg, "run_name") if name == "run_name" else (args, f"trainer.args.{name}")
        if name in target and target[name] != value:
            if (home in cli) == (alias in cli):
                raise ConfigError(
                    f"{alias}={value!r} and {home}={target[name]!r} are one setting with two values: keep one"
                )
            if home in cli:
                continue
        target[name], spelled[name] = value, alias
    return spelled


def flags_from_args(args: dict[str, Any]) -> list[str]:
    """[inference.args] -> command-line flags: {enforce_eager = true, max_model_len = 4096} ->
    --enforce-eager --max-model-len 4096 (false drops the flag; lists repeat the value)."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *[str(v) for v in value]]
        elif isinstance(value, dict):
            import json

            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def foreign_format(cfg: dict[str, Any]) -> str | None:
    """Name the format of a TOML file that is not ours (people copy configs between these tools)."""
    prime_rl = ("orchestrator", "inference_gpu_ids", "trainer_gpu_ids", "ckpt")
    if any(k in cfg for k in prime_rl) or isinstance(cfg.get("model"), dict) or "optim" in cfg.get("trainer", {}):
        return (
            "this is a prime-rl config ([orchestrator], [model], inference_gpu_ids, ...): run it with prime-rl "
            "(`uv run rl @ FILE`, as prime-rl's docs say); vf-rl takes model, [env], [inference], [trainer] "
            "(docs/coming-from-verifiers.md)"
        )
    return None


def _check_no_dates(node: Any, where: str) -> None:
    """A TOML date or time has no JSON form, and the resolved config travels as JSON (to the trainer processes, in
    the run plan): refuse it here, naming the key, rather than when the trainer starts."""
    if isinstance(node, dict):
        for key, value in node.items():
            _check_no_dates(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_no_dates(value, f"{where}[{i}]")
    elif isinstance(node, (datetime.date, datetime.time)):  # datetime.datetime is a date
        raise ConfigError(f'{where} = {node}: TOML dates and times are not supported; write it as a string, "{node}"')


def validate(cfg: dict[str, Any], command: str = "vf-rl") -> dict[str, Any]:
    other = foreign_format(cfg)
    if other:
        raise ConfigError(other)
    from verifiers_rl.config.hosted import from_hosted, is_hosted

    if command != "vf-sft" and is_hosted(cfg):  # verifiers' configs/rl/*.toml: run as written (hosted.py)
        from_hosted(cfg, {*SCHEMA, *SCHEMA[""]})
    if command == "vf-sft" and isinstance(cfg.get("wandb"), dict):  # `--wandb.project x`, as vf-rl takes it
        cfg.setdefault("trainer", {}).setdefault("args", {}).setdefault("wandb", {}).update(cfg.pop("wandb"))
    _check_no_dates(cfg, "")
    if isinstance(cfg.get("env"), list):
        _check_envs(cfg["env"], command)
        if len(cfg["env"]) == 1:  # one [[env]] table is one environment, as [env] is
            cfg["env"] = cfg["env"][0]
    for top, value in cfg.items():
        if top == "env" and isinstance(value, list):
            continue
        if isinstance(value, dict):
            if top not in SCHEMA:
                allowed = ", ".join(f"[{s}]" for s in SCHEMA if s)
                raise ConfigError(f"unknown section [{top}]{_suggest(top, SCHEMA)}; allowed: {allowed}")
            _check_section(top, value)
        else:
            _check_key("", top, value)
    for section, key in REQUIRED[command]:
        node = cfg.get(section, {}) if section else cfg
        if isinstance(node, list):  # [[env]]: each table was checked for its id
            continue
        if key not in node:
            where = f"[{section}] {key}" if section else key
            raise ConfigError(f"missing required key {where} in the config")
    for section in ("inference", "trainer"):
        gpus = cfg.get(section, {}).get("gpus")
        if gpus is not None and gpus < 0:
            raise ConfigError(f"{section}.gpus={gpus}: must be >= 0")
    if command != "vf-sft":
        spelled = fold_aliases(cfg)  # the one place the aliases fold; rl_config() takes the folded config
        _check_trainer_args(cfg.get("trainer", {}).get("args", {}), spelled)
    return cfg


def _check_envs(entries: list, command: str) -> None:
    """[[env]] tables: each an id (+ args, ratio), named `env[i]` in errors; the ratios sum to something positive."""
    from verifiers_rl.config.checks import check_ratios

    if command == "vf-sft":
        raise ConfigError("vf-sft takes one [env] (its [env.args] build the dataset), not [[env]] tables")
    if not entries:
        raise ConfigError("env: an empty list; give one [[env]] table per environment, each with an id")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"env[{i}]={entry!r}: each [[env]] is a table with an id")
        for key, value in entry.items():
            try:
                _check_key("env", key, value)
            except ConfigError as e:
                raise ConfigError(str(e).replace(f"env.{key}", f"env[{i}].{key}")) from None
        if "id" not in entry:
            raise ConfigError(f"env[{i}]: missing required key id (the environment to load)")
    try:
        check_ratios([e.get("ratio", 1.0) for e in entries], [e["id"] for e in entries])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_section(section: str, value: dict) -> None:
    for key, v in value.items():
        _check_key(section, key, v)


def _check_key(section: str, key: str, value: Any) -> None:
    allowed = SCHEMA[section]
    if key not in allowed and _key(section, key) in aliases():
        return  # an RLConfig field's other spelling: its type and rules are the field's (`_check_trainer_args`)
    if key not in allowed:
        allowed = {*allowed, *(a.split(".")[1] for a in aliases() if a.split(".")[0] == (section or None))}
        names = ", ".join(sorted(allowed))
        raise ConfigError(
            f"unknown key {_key(section, key)!r}{_suggest(key, allowed)}; "
            f"allowed in [{section or 'top level'}]: {names}"
        )
    want = allowed[key]
    if want is float:
        want = (int, float)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        names = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
        raise ConfigError(f"{_key(section, key)}={value!r}: expected {names}")


def _check_trainer_args(args: dict, spelled: dict[str, str] | None = None) -> None:
    """Keys, types and RLConfig's rules, from the generated schema: no torch or transformers import yet. `spelled`:
    fields the file wrote under another key ([inference] port), named that way in errors."""
    import warnings

    from verifiers_rl.config.legacy import translate_legacy_kwargs
    from verifiers_rl.config.schema import load_schema, rule_errors, type_errors

    schema = load_schema()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # RLConfig warns again when it is built
            args = translate_legacy_kwargs(args, "trainer.args")
    except ValueError as e:
        raise ConfigError(str(e).replace("invalid trainer.args: ", "trainer.args.")) from None
    for key in args:
        if key not in schema:
            raise ConfigError(
                f"unknown key 'trainer.args.{key}'{_suggest(key, schema)}; trainer.args takes RLConfig fields "
                "(see docs/configuration.md)"
            )
    errors = type_errors(args, schema) or rule_errors(args, schema)
    if errors:
        text = "; ".join(errors)
        for name, alias in (spelled or {}).items():
            text = text.replace(f"trainer.args.{name}=", f"{alias}=")
        raise ConfigError(text)


def rl_config(
    cfg: dict[str, Any],
    cuda: bool | None = None,
    quiet: bool = False,
    config_path: str | Path | None = None,
    **overrides,
):
    """Build and validate the RLConfig from a `validate`d config (its aliases folded into [trainer.args]); its
    ValueError names the field, re-raised as a ConfigError."""
    return build_rl_config(rl_arguments(cfg, config_path, **overrides), cuda, quiet)


def rl_arguments(cfg: dict[str, Any], config_path: str | Path | None = None, **overrides) -> dict[str, Any]:
    """The RLConfig keyword arguments a `validate`d config gives, output_dir resolved against `config_path`, before
    anything this process's hardware decides (`build_rl_config`): what vf-rl hands its trainer processes."""
    args = dict(cfg.get("trainer", {}).get("args", {}))
    run_name = cfg.get("run_name") or args.get("run_name")
    args["output_dir"] = output_path(args.get("output_dir") or cfg.get("output_dir"), run_name or "vf-rl", config_path)
    if run_name:
        args.setdefault("run_name", run_name)
    args.update(overrides)
    return args


def build_rl_config(arguments: dict[str, Any], cuda: bool | None = None, quiet: bool = False):
    """RLConfig(**arguments) on this process's hardware. Without CUDA the trainer runs on the CPU: half-precision
    flags are dropped (with a notice) instead of failing, so one config serves a GPU box and a laptop."""
    from verifiers_rl.config.rl_config import RLConfig

    args = dict(arguments)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        dropped = [k for k in ("bf16", "fp16") if args.pop(k, False)]
        if dropped and not quiet:
            print(f"note: no CUDA device: training on CPU in float32 (ignoring {', '.join(dropped)})", file=sys.stderr)
        args["use_cpu"] = True
    import warnings

    from verifiers_rl.config.legacy import lora_without_lora

    if (unused := lora_without_lora(args)) and not quiet:
        print(f"note: use_lora = false (full fine-tuning): {unused} are ignored", file=sys.stderr)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "RLConfig: use_lora=False")  # said above, in the TOML's words
            return RLConfig(**args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[trainer.args] {e}") from None
