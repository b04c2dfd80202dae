"""What `vf-rl` checks before it starts anything (the SFT warm-start, the server, the trainer), and `--dry-run`
fails on with the same line: the environment is installed and loads, wandb has a login when the run reports to it
online, and the prompts fit the prompt limit (measured as the trainer measures them: the model's chat template,
the run's template arguments, the environment's tool schemas). Each of these used to fail after the server started.
"""

from __future__ import annotations

import os
from typing import Any

from verifiers_rl.config.reporting import wandb_login_problem
from verifiers_rl.errors import ConfigError


def preflight(plan) -> list[str]:
    """Raise the first problem as the run would (ConfigError, or the trainer's TrainingError for the prompts);
    return the plan's `# checks` lines. Keeps the loaded environment on the plan for the run."""
    from verifiers_rl.rollouts.env_mix import as_environment
    from verifiers_rl.rollouts.prompts import filter_run_prompts
    from verifiers_rl.rollouts.reward_checks import training_dataset
    from verifiers_rl.scripts.common import load_env

    problem = wandb_login_problem(plan.args)
    if problem:
        raise ConfigError(problem)
    plan.env = load_env(plan.run_file)  # not installed, broken, or [env.args] it does not take: one line
    lines = ["environment: installed and loaded"]
    tokenizer, source = _tokenizer(plan)
    if tokenizer is None:
        return [*lines, f"prompt lengths: not checked here ({source})"]
    env = as_environment(plan.env)
    dataset = training_dataset(env)
    rows, dropped = filter_run_prompts(dataset, tokenizer, plan.args, env)  # every prompt too long: TrainingError
    n = len(dataset) if dataset is not None else 0
    kept = f"{n - dropped} of {n}" if dropped else f"all {n}"
    return [
        *lines,
        f"prompt lengths: {kept} prompts fit the prompt limit of {plan.args.prompt_limit} tokens ({source})",
    ]


def _tokenizer(plan) -> tuple[Any, str]:
    """The tokenizer the trainer will use, or (None, why not): a dry run planning a hub model that is not on this
    machine cannot measure."""
    from verifiers_rl.model_source import looks_like_path

    run, model = plan.run_file, plan.model
    if plan.sft and not plan.sft.done:  # the warm-start keeps its base model's tokenizer
        from verifiers_rl.scripts.common import resolve_model

        run, model = plan.sft.file, resolve_model(plan.sft.file, dry_run=True)
    if run.model == "tiny" and not os.path.isdir(model):
        from verifiers_rl.tiny import build_tokenizer

        return build_tokenizer(), "the tiny model's tokenizer"
    if not os.path.isdir(model) and (looks_like_path(model) or _not_cached(model)):
        return None, f"{model} is not on this machine"
    from verifiers_rl.models import get_tokenizer

    try:
        return get_tokenizer(model), f"{model}'s tokenizer"
    except (OSError, ValueError) as e:  # a folder without a usable tokenizer: the trainer would fail the same way
        raise ConfigError(f"cannot load the tokenizer of {model}: {e}".splitlines()[0]) from None


def _not_cached(model: str) -> bool:
    from verifiers_rl.model_source import resolve_model_path

    try:
        resolve_model_path(model)
    except (OSError, ValueError):
        return True
    return False
