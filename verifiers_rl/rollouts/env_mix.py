"""Several environments in one run: verifiers' `EnvGroup` with a sampling ratio per environment.

`as_environment` turns what `RLTrainer(env=...)` is given (one environment, a list, a {name: env} dict, a
`vf.EnvGroup`, or `mix_environments(...)`'s group) into one environment; a mixture is an `EnvGroup` whose
`vf_rl_ratios` holds one ratio per environment (1 each unless given). verifiers' EnvGroup concatenates the datasets
and routes each row by `info["env_id"]`; what it does not do is choose how often each environment is drawn, which
`MixedRows` does here: prompt positions go to environments by smooth weighted round-robin (every prefix of the
stream holds each environment within one or two prompts of its share, so each batch is mixed as the ratios say), and
each environment draws its own rows from its own seeded per-epoch permutations. Everything is a function of
(seed, position): a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import functools
import json
import math
from fractions import Fraction

import numpy as np

from verifiers_rl.config.checks import check_ratios
from verifiers_rl.errors import TrainingError

RATIOS = "vf_rl_ratios"  # the EnvGroup attribute that holds one sampling ratio per environment


def env_name_of(row: dict) -> str | None:
    """The environment an EnvGroup row routes to (the first step of `info["env_id"]`), or None."""
    info = row.get("info")
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError:
            return None
    route = info.get("env_id") if isinstance(info, dict) else None
    if isinstance(route, (list, tuple)):
        route = route[0] if route else None
    return route if isinstance(route, str) else None


def mix_environments(envs, ratios=None, names=None):
    """One `vf.EnvGroup` of `envs` (a list, or a {name: env} dict) drawn by `ratios` (default 1 each): pass it as
    `RLTrainer(env=...)`. Names default to each environment's id (`reverse-text`); they key the per-environment
    metrics (`reward/<name>`)."""
    import verifiers as vf

    if isinstance(envs, dict):
        names, envs = list(envs), list(envs.values())
    envs = list(envs)
    if not envs:
        raise ValueError("mix_environments needs at least one environment")
    for i, env in enumerate(envs):
        if not isinstance(env, vf.Environment):
            raise TypeError(f"env[{i}] is a {type(env).__name__}, not a verifiers Environment")
    names = list(names) if names is not None else _default_names(envs)
    if len(set(names)) != len(names):
        raise ValueError(f"environment names must differ: {names}")
    ratios = check_ratios(ratios if ratios is not None else [1.0] * len(envs), names)
    for i, (name, env) in enumerate(zip(names, envs)):
        if _size(env) == 0:
            raise TrainingError(f"env[{i}] ({name}) has no training rows: give it at least one training example")
    group = vf.EnvGroup(envs, env_names=names)
    setattr(group, RATIOS, ratios)
    return group


def _default_names(envs) -> list[str]:
    base = [str(getattr(e, "env_id", None) or f"env_{i}").split("/")[-1] for i, e in enumerate(envs)]
    return [n if base.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(base)]


def _size(env) -> int:
    try:
        dataset = env.get_dataset()
    except ValueError:  # verifiers: "dataset is not set"
        return 0
    return 0 if dataset is None else len(dataset)


def as_environment(env):
    """What RLTrainer trains on: one environment as is; a list or dict of them, or an EnvGroup without ratios, as
    a mixture with a ratio of 1 each."""
    import verifiers as vf

    if isinstance(env, (list, tuple, dict)):
        return mix_environments(env)
    if isinstance(env, vf.EnvGroup) and not hasattr(env, RATIOS):
        setattr(env, RATIOS, [1.0] * len(env.envs))
    return env


def eval_rows(env, n: int):
    """The eval rows: n (all with n <= 0) per environment of a mixture, so that each is evaluated; an environment
    without an eval split is evaluated on its training rows (verifiers' own fallback for one environment)."""
    if not hasattr(env, RATIOS):
        return env.get_eval_dataset(n=n)
    from datasets import concatenate_datasets

    evals = env.get_eval_dataset()
    parts = []
    for name in env.env_names:
        rows = _rows_of(evals, name)
        source = evals if rows else env.get_dataset()
        rows = rows or _rows_of(source, name)
        parts.append(source.select(rows[:n] if n > 0 else rows))
    return concatenate_datasets(parts)


def _rows_of(dataset, name: str) -> list[int]:
    return [i for i, info in enumerate(dataset["info"]) if env_name_of({"info": info}) == name]


@functools.lru_cache(maxsize=16)
def _permutation(seed: int, env: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, env, epoch]).permutation(n)


class MixedRows:
    """Which dataset rows a batch draws from a mixture: position p of the prompt stream goes to environment
    `order[p]` (smooth weighted round-robin over integer weights: exact, the same on every machine), the j-th
    position of environment k to row j of k's endless stream of seeded per-epoch permutations."""

    def __init__(self, names: list[str], ratios: list[float], rows: dict[str, list[int]]):
        self.names, self.rows = names, [rows[n] for n in names]
        fractions = [Fraction(str(r)).limit_denominator(10**6) for r in ratios]
        scale = math.lcm(*(f.denominator for f in fractions))
        self.weights = [int(f * scale) for f in fractions]
        self._current = [0] * len(names)
        self.order: list[int] = []

    @classmethod
    def of(cls, env, dataset) -> MixedRows | None:
        """None for one environment; else the mixture's rows (after prompt filtering), each drawn environment
        holding at least one (a TrainingError names the one that does not)."""
        ratios = getattr(env, RATIOS, None)
        if ratios is None:
            return None
        names = list(env.env_names)
        rows: dict[str, list[int]] = {n: [] for n in names}
        for i, info in enumerate(dataset["info"]):
            name = env_name_of({"info": info})
            if name in rows:
                rows[name].append(i)
        for i, name in enumerate(names):
            if ratios[i] > 0 and not rows[name]:
                raise TrainingError(
                    f"env[{i}] ({name}) has no training rows left (every prompt longer than prompt_limit?): "
                    "give it shorter prompts, or a ratio of 0"
                )
        return cls(names, ratios, rows)

    def _extend(self, n: int) -> None:
        total, current, weights = sum(self.weights), self._current, self.weights
        while len(self.order) < n:
            for k, w in enumerate(weights):
                current[k] += w
            best = max(range(len(weights)), key=lambda k: (current[k], -k))
            current[best] -= total
            self.order.append(best)

    def batch(self, index: int, prompts: int, seed: int, shuffle: bool) -> list[int]:
        """Dataset rows of batch `index` (positions [index*prompts, (index+1)*prompts) of the stream)."""
        start = index * prompts
        self._extend(start + prompts)
        seen = [self.order[:start].count(k) for k in range(len(self.names))]
        out = []
        for k in self.order[start : start + prompts]:
            rows = self.rows[k]
            epoch, i = divmod(seen[k], len(rows))
            seen[k] += 1
            out.append(rows[int(_permutation(seed, k, epoch, len(rows))[i]) if shuffle else i])
        return out
