"""Several environments in one run: the ratio mixing of prompts (deterministic per seed), per-environment metrics,
and the one-line errors of bad mixtures (env_mix.py)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from verifiers_rl.config.checks import check_ratios
from verifiers_rl.errors import TrainingError
from verifiers_rl.rollouts.env_mix import MixedRows, env_name_of
from verifiers_rl.rollouts.metrics import rollout_metrics
from verifiers_rl.rollouts.rollouts import Rollout

ROWS = {"a": list(range(0, 10)), "b": list(range(10, 13))}  # dataset rows of each environment


def _env_of(row: int) -> str:
    return "a" if row < 10 else "b"


def test_every_batch_is_mixed_by_the_ratios():
    mix = MixedRows(["a", "b"], [3, 1], ROWS)
    for index in range(12):
        counts = Counter(_env_of(r) for r in mix.batch(index, 8, seed=0, shuffle=True))
        assert counts == {"a": 6, "b": 2}, (index, counts)
    uneven = MixedRows(["a", "b"], [0.7, 0.3], ROWS)  # 8 * 0.3 = 2.4 a batch: 2 or 3, 30% over the run
    drawn = [_env_of(r) for i in range(50) for r in uneven.batch(i, 8, seed=0, shuffle=True)]
    assert drawn.count("b") == 120
    for i in range(50):
        assert drawn[i * 8 : (i + 1) * 8].count("b") in (2, 3)


def test_each_environment_draws_its_rows_epoch_by_epoch():
    mix = MixedRows(["a", "b"], [1, 1], ROWS)
    drawn = [r for i in range(10) for r in mix.batch(i, 6, seed=0, shuffle=True)]
    b_rows = [r for r in drawn if _env_of(r) == "b"]  # 30 draws of 3 rows: 10 epochs, each a permutation
    assert all(sorted(b_rows[k : k + 3]) == ROWS["b"] for k in range(0, 30, 3))
    a_rows = [r for r in drawn if _env_of(r) == "a"]
    assert all(sorted(a_rows[k : k + 10]) == ROWS["a"] for k in range(0, 30, 10))
    assert b_rows[:3] != b_rows[3:6] or b_rows[3:6] != b_rows[6:9]  # shuffled anew each epoch


def test_batches_are_a_function_of_seed_and_index():
    """The same seed draws the same batches, in whatever order they are asked for (a resumed run asks for batch 5
    first); another seed draws other rows, mixed alike."""
    first = MixedRows(["a", "b"], [2, 1], ROWS)
    run = [first.batch(i, 6, seed=7, shuffle=True) for i in range(6)]
    resumed = MixedRows(["a", "b"], [2, 1], ROWS)
    assert resumed.batch(5, 6, seed=7, shuffle=True) == run[5]
    assert [resumed.batch(i, 6, seed=7, shuffle=True) for i in range(6)] == run
    other = [MixedRows(["a", "b"], [2, 1], ROWS).batch(i, 6, seed=8, shuffle=True) for i in range(6)]
    assert other != run
    assert [sorted(map(_env_of, b)) for b in other] == [sorted(map(_env_of, b)) for b in run]


def test_a_zero_ratio_environment_is_never_drawn():
    mix = MixedRows(["a", "b"], [1, 0], ROWS)
    assert all(_env_of(r) == "a" for i in range(5) for r in mix.batch(i, 4, seed=0, shuffle=False))


@pytest.mark.parametrize(
    "ratios, message",
    [
        ([1, -1], "env[1].ratio=-1: a sampling ratio is a number >= 0"),
        ([0, 0.0], "env[0].ratio=0, env[1].ratio=0.0: the ratios sum to 0"),
        ([1, float("nan")], "env[1].ratio=nan"),
        ([1, "2"], "env[1].ratio='2'"),
        ([1], "1 ratios for 2 environments"),
    ],
)
def test_bad_ratios_are_named(ratios, message):
    with pytest.raises(ValueError) as e:
        check_ratios(ratios, ["a", "b"])
    assert message in str(e.value)


def test_an_environment_with_no_rows_left_is_named():
    class Group:
        env_names = ["a", "b"]
        vf_rl_ratios = [1.0, 1.0]

    dataset = {"info": [{"env_id": "a"}, {"env_id": "a"}]}
    with pytest.raises(TrainingError, match=r"env\[1\] \(b\) has no training rows"):
        MixedRows.of(Group(), dataset)
    Group.vf_rl_ratios = [1.0, 0.0]  # never drawn: no rows needed
    assert MixedRows.of(Group(), dataset).rows == [[0, 1], []]


def test_rows_route_by_their_info():
    assert env_name_of({"info": {"env_id": "a"}}) == "a"
    assert env_name_of({"info": '{"env_id": ["b", "inner"]}'}) == "b"
    assert env_name_of({"info": {}}) is None and env_name_of({}) is None


def _rollout(env, reward, error=None):
    return Rollout(group=0, reward=reward, turns=[], is_truncated=False, error=error, policy_version=0, env=env)


def test_metrics_split_reward_by_environment():
    rollouts = [_rollout("a", 1.0), _rollout("a", 0.0), _rollout("b", 0.5), _rollout("b", 0.0, error="boom")]
    m = rollout_metrics(rollouts, "eval")
    assert m["eval/reward/a"] == 0.5 and m["eval/reward/b"] == 0.5  # b's errored rollout has no reward
    assert m["eval/rollouts/a"] == 2 and m["eval/rollouts/b"] == 2
    assert m["eval/perfect_frac"] == pytest.approx(1 / 3)  # one 1.0 of three finished rollouts
    assert math.isnan(rollout_metrics([_rollout("c", 1.0, error="x")])["reward/c"])
    assert not any(k.startswith("reward/") for k in rollout_metrics([_rollout(None, 1.0)]))  # one environment


def test_python_api_takes_a_list_or_an_env_group():
    import verifiers as vf

    from verifiers_rl.rollouts.env_mix import RATIOS, as_environment, mix_environments
    from verifiers_rl.scripts.environments import load_environment

    a = load_environment("reverse-text", {"num_train_examples": 4, "num_eval_examples": 2})
    b = load_environment("alphabet-sort", {"num_train_examples": 6, "num_eval_examples": 2})
    group = as_environment([a, b])
    assert isinstance(group, vf.EnvGroup) and group.env_names == ["reverse-text", "alphabet-sort"]
    assert getattr(group, RATIOS) == [1.0, 1.0] and len(group.get_dataset()) == 10
    theirs = as_environment(vf.EnvGroup([a, b], env_names=["x", "y"]))
    assert getattr(theirs, RATIOS) == [1.0, 1.0]  # verifiers' own EnvGroup: each environment equally often
    mixed = mix_environments({"x": a, "y": b}, ratios=[3, 1])
    m = MixedRows.of(mixed, mixed.get_dataset())
    assert Counter(env_name_of(mixed.get_dataset()[r]) for r in m.batch(0, 4, 0, True)) == {"x": 3, "y": 1}
    with pytest.raises(ValueError, match=r"env\[1\].ratio=-2"):
        mix_environments([a, b], ratios=[1, -2])


def test_toml_entries_that_fail_to_load_are_named():
    from verifiers_rl.config.run_file import Env
    from verifiers_rl.errors import ConfigError
    from verifiers_rl.scripts.environments import load_environments

    with pytest.raises(ConfigError, match=r"^env\[1\]: environment 'no-such-env' is not installed"):
        load_environments([Env(id="reverse-text"), Env(id="no-such-env")])
    empty = [Env(id="reverse-text"), Env(id="alphabet-sort", args={"num_train_examples": 0})]
    with pytest.raises(ConfigError, match=r"^env\[1\]: environment 'alphabet-sort' has no training examples with "
                       r"env\[1\].args.num_train_examples=0"):  # fmt: skip
        load_environments(empty)
