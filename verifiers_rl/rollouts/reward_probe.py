"""The rollout process's check before the first batch: its copy of the environment scores the first training example
with every reward function and metric. Code that fails there but not in the trainer's process (a module made at
run time, state set up after `train()` started) would fail every rollout of every step under a misleading cause;
the trainer generates in its own process instead, with one log line naming the function and its error. A function
that fails in both processes is left to the run, which names it per step.
"""

from __future__ import annotations

import inspect

from verifiers_rl.rollouts.reward_checks import _rubrics
from verifiers_rl.rollouts.rollouts import REWARD_ERRORS_KEY


async def reward_failures(env, row: dict, client, model: str) -> list[str]:
    """Every reward function of `env` on one training example, answered with its own `answer`: how each one that
    fails does ("reward function NAME raised TYPE: message"). The same example in both processes tells code that does
    not run in the rollout process (a name its copy lacks) from code that fails wherever it runs."""
    try:
        state = await env.init_state(row, client, model)
    except Exception as e:  # noqa: BLE001 - compared between the processes, not raised
        return [f"the environment's init_state raised {type(e).__name__}: {e}"]
    state["completion"] = _answer_of(row, state.get("answer"))
    failures = []
    for rubric in _rubrics(env.rubric):
        for func in getattr(rubric, "funcs", None) or []:
            recorded = len(state.get(REWARD_ERRORS_KEY) or [])
            try:
                await _score(rubric, func, state)
            except Exception as e:  # noqa: BLE001 - a metric's error: guarded reward functions record theirs
                name = getattr(func, "__name__", repr(func))
                failures.append(f"reward function {name} raised {type(e).__name__}: {e}")
            failures.extend((state.get(REWARD_ERRORS_KEY) or [])[recorded:])
    return failures


def _answer_of(row: dict, answer):
    """A completion that gives the example's answer, in the example's format."""
    from verifiers.utils.message_utils import normalize_messages

    text = answer if isinstance(answer, str) else ""
    if isinstance(row.get("prompt"), str):
        return text
    return normalize_messages([{"role": "assistant", "content": text}])


async def _score(rubric, func, state) -> None:
    """`func` called as verifiers' Rubric calls it (the arguments it names, or all of them), its errors raised."""
    objects = rubric.group_score_objects([state]) if rubric._is_group_func(func) else rubric.score_objects(state)
    params = inspect.signature(func).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        objects = {k: v for k, v in objects.items() if k in params}
    value = func(**objects)
    if inspect.isawaitable(value):
        await value


def only_in_child(there: list[str], here: list[str]) -> str | None:
    """The first failure of the child's that the trainer's process does not have: the same function failing with
    another exception counts (a NameError there, the example's own KeyError here)."""
    kinds = {_kind(f) for f in here}
    return next((f for f in there if _kind(f) not in kinds), None)


def _kind(failure: str) -> str:
    return failure.split(":", 1)[0]  # "reward function NAME raised TYPE"
