"""Loading a verifiers environment for a command, with messages that lead somewhere.

verifiers' `load_environment` turns every import failure into "Could not import ... Ensure the package is
installed", also when the package *is* installed and one of its own dependencies is missing. Here the module
is imported first, so the message says which of the two happened, and `[env.args]` are checked against the
environment's `load_environment` signature before anything heavy starts.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verifiers_rl.config.toml import ConfigError, suggest

if TYPE_CHECKING:
    from verifiers_rl.config.run_file import Env


def module_name(env_id: str) -> str:
    return env_id.replace("-", "_").split("/")[-1]


def install_hint(env_id: str) -> str:
    if "/" in env_id:  # an Environments Hub id: owner/name
        return f"`prime env install {env_id}`"
    local = Path("environments") / module_name(env_id)
    if local.is_dir():
        return f"`pip install -e {local}`"
    return f"`vf-install {env_id}` (or `pip install -e path/to/environments/{module_name(env_id)}`)"


def environment_status(env_id: str) -> str:
    """One line for `--dry-run`: is the environment installed here, and if not, how to install it (found without
    importing it: a dry run plans, it runs none of the environment's code)."""
    import importlib.util

    name = module_name(env_id)
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return f"{env_id} (module {name}, installed)"
    return f"{env_id}: NOT installed here (no module {name!r}); install it with {install_hint(env_id)}"


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__
    return error


def import_environment(env_id: str):
    """The environment's module, or a ConfigError that says whether it is missing or broken."""
    name = module_name(env_id)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise ConfigError(
                f"environment {env_id!r} is not installed: install it with {install_hint(env_id)}"
            ) from None
        raise ConfigError(
            f"environment {env_id!r} is installed but importing it failed: No module named {e.name!r} "
            f"(install the environment's dependencies, e.g. `pip install {e.name}`)"
        ) from None
    except Exception as e:  # noqa: BLE001 - any error while importing the env's own code
        cause = _root_cause(e)
        raise ConfigError(f"environment {env_id!r} failed to import: {type(cause).__name__}: {cause}") from None


def check_env_args(env_id: str, module, args: dict[str, Any]) -> None:
    """[env.args] keys the environment's load_environment does not take are an error; a warning when it
    takes **kwargs (the environment may pass them on, or ignore them)."""
    load = getattr(module, "load_environment", None)
    if load is None:
        raise ConfigError(
            f"module {module.__name__!r} has no load_environment(); is another package named like environment "
            f"{env_id!r} installed?"
        )
    params = inspect.signature(load).parameters
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = [k for k in args if k not in named]
    if not unknown:
        return
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    listing = ", ".join(sorted(named)) or "none"
    for key in unknown:
        line = f"env.args.{key}{suggest(key, named)}: load_environment of {env_id!r} takes {listing}"
        if not takes_kwargs:
            raise ConfigError(f"unknown key {line}")
        warnings.warn(f"{line} (and **kwargs, so it is passed on)", UserWarning, stacklevel=2)


def load_environment(env_id: str, args: dict[str, Any] | None = None):
    import verifiers as vf

    args = dict(args or {})
    module = import_environment(env_id)
    check_env_args(env_id, module, args)
    try:
        env = vf.load_environment(env_id, **args)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the environment's own load failed: name the root cause
        cause = _root_cause(e)
        raise ConfigError(f"environment {env_id!r} failed to load: {type(cause).__name__}: {cause}") from None
    require_training_data(env_id, env, args)
    return env


def load_environments(entries: list[Env]):
    """[[env]] tables -> one `vf.EnvGroup` with a sampling ratio per environment (env_mix.py); each environment is
    loaded and checked as a single [env] is, and a failure names its entry (`env[1]: ...`). Names: the ids' last
    part (`primeintellect/reverse-text` -> `reverse-text`), numbered when one id comes twice."""
    from verifiers_rl.rollouts.env_mix import mix_environments

    envs = []
    for i, entry in enumerate(entries):
        try:
            envs.append(load_environment(entry.id, entry.args))
        except ConfigError as e:
            raise ConfigError(f"env[{i}]: {e}".replace("env.args.", f"env[{i}].args.")) from None
    base = [e.id.split("/")[-1] for e in entries]
    names = [n if base.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(base)]
    return mix_environments(envs, ratios=[_ratio(e) for e in entries], names=names)


def _ratio(entry: Env) -> float:
    return 1.0 if entry.ratio is None else entry.ratio


def environments_status(entries: list[Env]) -> list[str]:
    """`--dry-run`'s environment lines: one per [[env]] table (with its ratio), or the single [env]'s."""
    if len(entries) == 1:
        return [environment_status(entries[0].id)]
    total = sum(_ratio(e) for e in entries)
    return [f"env[{i}] {environment_status(e.id)}, ratio {_ratio(e) / total:.0%}" for i, e in enumerate(entries)]


def require_training_data(env_id: str, env, args: dict[str, Any]) -> None:
    """Every command trains on the environment's dataset: an environment built without one (verifiers' own
    `get_dataset()` then raises "dataset is not set") is named here with the [env.args] that emptied it."""
    dataset = getattr(env, "dataset", None)
    if dataset is None and getattr(env, "dataset_source", None) is not None:
        try:
            dataset = env.get_dataset()
        except ValueError:
            dataset = None
    if dataset is not None and len(dataset) > 0:
        return
    # the arguments that can empty a dataset: counts set to zero (num_train_examples = 0), empty selections
    culprits = [f"env.args.{k}={v!r}" for k, v in args.items() if v in (0, [], "", {}) and not isinstance(v, bool)]
    given = ", ".join(culprits) or (f"env.args {args}" if args else "its default arguments")
    raise ConfigError(
        f"environment {env_id!r} has no training examples with {given}: "
        "give it at least one training example (e.g. a positive num_train_examples)"
    )
