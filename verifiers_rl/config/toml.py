"""A run file as TOML, in our spelling: load it, apply the command line's overrides, move other tools' and other
spellings' keys onto ours (`ours`), and resolve the paths it names against its folder. `run_file.RunFile` checks
what comes out and is what the rest of the program reads.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import os
import tomllib
from pathlib import Path
from typing import Any

from verifiers_rl.errors import ConfigError


def suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


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


def apply_overrides(cfg: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], frozenset[str]]:
    """`--section.key value` pairs (or `--section.key=value`) onto a copy of the loaded file; returns it and the
    dotted keys the command line set (they win over the file's other spelling of the same setting)."""
    cfg, seen = copy.deepcopy(cfg), set()
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
    return cfg, frozenset(seen)


def aliases() -> dict[str, str]:
    """{TOML key outside [trainer.args]: the RLConfig field it spells}, from the fields' own metadata (the
    generated schema), plus upstream's `[trainer] run_name`."""
    from verifiers_rl.config.schema import load_schema

    table = {entry["toml"]: name for name, entry in load_schema().items() if entry.get("toml")}
    return {**table, "trainer.run_name": "run_name"}


def fold_aliases(cfg: dict[str, Any], cli: frozenset[str] = frozenset()) -> dict[str, str]:
    """One setting, one home: `[inference] host/port/startup_timeout/engine/args` (upstream vf-rl's spelling) move
    into `[trainer.args]` under their RLConfig names, so vf-rl, vf-train and `RLConfig(...)` read one value. Two
    different values for one setting stop here with one line naming both keys; a command-line override beats the
    file's other spelling. Returns {field: the key the file spelled it with}, for error messages."""
    spelled: dict[str, str] = {}
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


def ours(cfg: dict[str, Any], cli: frozenset[str], command: str) -> tuple[dict[str, Any], dict[str, str], bool]:
    """The file in our spelling, for `RunFile` to check: a Hosted Training config's keys moved onto ours, vf-sft's
    [wandb] into [trainer.args], the [inference] aliases folded into [trainer.args], and [env] as a list of
    tables. Returns it, {field: the key the file spelled it with} (for errors) and whether it names several
    environments."""
    if other := foreign_format(cfg):
        raise ConfigError(other)
    _check_no_dates(cfg, "")
    spelled: dict[str, str] = {}
    if command != "vf-sft":
        spelled = fold_aliases(cfg, cli)  # the one place the aliases fold
        from verifiers_rl.config.hosted import from_hosted

        from_hosted(cfg, OUR_KEYS, cli)  # verifiers' configs/rl/*.toml, run as written; others are left as they are
    else:
        if isinstance(cfg.get("wandb"), dict):  # `--wandb.project x`, as vf-rl takes it
            cfg.setdefault("trainer", {}).setdefault("args", {}).setdefault("wandb", {}).update(cfg.pop("wandb"))
        for alias in aliases():  # the server's settings mean nothing to a warm-start
            section, key = alias.split(".")
            if isinstance(cfg.get(section), dict):
                cfg[section].pop(key, None)
    env = cfg.get("env")
    several = isinstance(env, list) and len(env) > 1
    if isinstance(env, dict):
        cfg["env"] = [env]
    return cfg, spelled, several


# our top-level keys and sections: a Hosted Training config keeps these as they are
OUR_KEYS = {"model", "output_dir", "run_name", "env", "inference", "trainer", "sft", "tiny", "eval", "dataset"}
