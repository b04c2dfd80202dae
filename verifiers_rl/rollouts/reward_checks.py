"""Broken environments are named, not scored.

verifiers 0.1.14 scores a reward function that raises as 0 (and a function that returns None or a string is
then a TypeError, also 0): a broken environment trains on noise without a word. Here every weighted reward
function is wrapped so that a raise, a non-number or a non-finite value marks the rollout as errored, with the
function's name and the first message; such rollouts are left out of the advantages and counted per step, and
a run whose every rollout fails stops after `max_empty_steps` with that message. What can be checked before a
rollout runs (a function reading a dataset column that does not exist) is checked up front.
"""

from __future__ import annotations

import inspect
import math

from verifiers_rl.errors import TrainingError
from verifiers_rl.rollouts.rollouts import REWARD_ERRORS_KEY
from verifiers_rl.rollouts.stages import Stages, watch_environment

_GUARDED = "__vf_rl_guarded__"
ROW_FIELDS = ("answer", "info", "task")  # reward-function arguments that come from the dataset's columns


def _rubrics(rubric):
    yield rubric
    for inner in getattr(rubric, "rubrics", None) or []:
        yield from _rubrics(inner)
    for env in (getattr(rubric, "env_map", None) or {}).values():  # an EnvGroup's: each environment's own rubric
        yield from _rubrics(env.rubric)


def _record(states, name: str, what: str) -> None:
    for state in states:
        if state is not None and hasattr(state, "setdefault"):
            state.setdefault(REWARD_ERRORS_KEY, []).append(f"reward function {name} {what}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _guard(func, group: bool, stages: Stages, checked: bool = True):
    sig = inspect.signature(func)
    params = sig.parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    state_name = "states" if group else "state"
    name = getattr(func, "__name__", repr(func))

    async def guarded(**kwargs):
        states = kwargs.get("states") if group else [kwargs.get("state")]
        call = kwargs if takes_all else {k: v for k, v in kwargs.items() if k in params}
        try:
            with stages.track("scoring", f"reward function {name}"):
                value = func(**call)
                if inspect.isawaitable(value):
                    value = await value
        except Exception as e:
            if not checked:  # a metric (weight 0): verifiers logs its errors and scores it 0, as before
                raise  # noqa: BLE001 - recorded against the rollout(s), scored as failed
            _record(states or [], name, f"raised {type(e).__name__}: {e}")
            return [0.0] * len(states or []) if group else 0.0
        if not checked:
            return value
        if group:
            values = list(value) if isinstance(value, (list, tuple)) else None
            if values is None or len(values) != len(states or []):
                _record(states or [], name, f"returned {value!r}, not one number per rollout")
                return [0.0] * len(states or [])
            for state, v in zip(states, values):
                if not _number(v):
                    _record([state], name, f"returned {v!r}, not a finite number")
            return [float(v) if _number(v) else 0.0 for v in values]
        if not _number(value):
            _record(states, name, f"returned {value!r}, not a finite number")
            return 0.0
        return float(value)

    extra = [] if takes_all or state_name in params else [inspect.Parameter(state_name, inspect.Parameter.KEYWORD_ONLY)]
    guarded.__signature__ = sig.replace(parameters=[*params.values(), *extra], return_annotation=sig.return_annotation)
    guarded.__name__ = name
    setattr(guarded, _GUARDED, True)
    return guarded


def guard_rewards(env) -> None:
    """Wrap the environment's reward functions (idempotent): weighted ones are checked, metrics (weight 0) score
    as before. Each call is marked as the scoring stage of its rollout (stages.py), so a function that never
    returns is named."""
    stages = watch_environment(env)
    for rubric in _rubrics(env.rubric):
        funcs, weights = getattr(rubric, "funcs", None), getattr(rubric, "weights", None)
        if not funcs:
            continue
        for i, func in enumerate(funcs):
            weight = weights[i] if weights and i < len(weights) else 1.0
            if getattr(func, _GUARDED, False):
                continue
            funcs[i] = _guard(func, rubric._is_group_func(func), stages, checked=weight != 0)


def check_reward_inputs(env, dataset) -> None:
    """A reward function that reads a column the dataset does not have would score every rollout against an
    empty default: refuse it before the run starts."""
    columns = set(getattr(dataset, "column_names", None) or [])
    for rubric in _rubrics(env.rubric):
        for func in getattr(rubric, "funcs", None) or []:
            params = inspect.signature(func).parameters
            for field in ROW_FIELDS:
                if field in params and field not in columns and params[field].default is inspect.Parameter.empty:
                    name = getattr(func, "__name__", repr(func))
                    raise TrainingError(
                        f"reward function {name} reads `{field}`, but the training dataset has no {field!r} column "
                        f"(columns: {', '.join(sorted(columns)) or 'none'})"
                    )


def training_dataset(env):
    """The environment's training dataset; an environment built without one is a TrainingError, not verifiers'
    bare "dataset is not set"."""
    try:
        return env.get_dataset()
    except ValueError as e:
        raise TrainingError(
            f"the environment ({type(env).__name__}) has no training dataset ({e}): build it with training "
            "examples (for vf-rl: [env.args] that give it at least one, e.g. a positive num_train_examples)"
        ) from None


def check_dataset(env, dataset) -> None:
    """The training dataset exists, is not empty and has the prompts rollouts start from."""
    name = type(env).__name__
    if dataset is None or len(dataset) == 0:
        raise TrainingError(f"the training dataset of the environment ({name}) is empty")
    if "prompt" not in dataset.column_names:
        raise TrainingError(
            f"the training dataset of the environment ({name}) has no 'prompt' column (columns: "
            f"{', '.join(dataset.column_names)}); verifiers builds it from a 'question' column"
        )
