"""Multi-turn warm-start data: the environment's own turns around reference replies, one sample per assistant turn;
and the run summary that reports the warm-start's and RL's shares."""

import pytest

from verifiers_rl.errors import ConfigError
from verifiers_rl.scripts.report import summarize
from verifiers_rl.scripts.sft_transcripts import load_replies, per_turn_samples, transcript_samples


def test_per_turn_samples_split_a_conversation_at_each_assistant_turn():
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    completion = [
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
    first, second = per_turn_samples(prompt, completion)
    assert [m["content"] for m in first["prompt"]] == ["s", "u1"] and first["completion"][0]["content"] == "a1"
    assert [m["content"] for m in second["prompt"]] == ["s", "u1", "a1", "u2"]
    assert second["completion"] == [{"role": "assistant", "content": "a2"}]


def test_alphabet_sort_reference_transcripts_score_one_and_follow_the_environment():
    import alphabet_sort

    env = alphabet_sort.load_environment(num_train_examples=6, num_eval_examples=1, min_turns=2, max_turns=3)
    rows = env.get_dataset()
    samples, reward = transcript_samples(env, rows, load_replies("alphabet_sort:reference_replies"))
    assert reward == 1.0
    assert len(samples) == sum(len(r["info"]["turns"]) for r in rows)
    last = samples[len(rows[0]["info"]["turns"]) - 1]  # the first episode's last turn
    info = rows[0]["info"]
    # the user turns in its prompt are the environment's, for the names of each later turn
    users = [m["content"] for m in last["prompt"] if m["role"] == "user"]
    assert users == [alphabet_sort.turn_message(t, info["turns"][t], info["sort_by"]) for t in range(len(users))]
    assert last["completion"][0]["content"] == alphabet_sort.reference_replies(info)[-1]


@pytest.mark.parametrize("spec", ["alphabet_sort", "alphabet_sort:nope", "no_such_module:f", ":f"])
def test_bad_replies_specs_are_config_errors(spec):
    with pytest.raises(ConfigError, match="dataset.replies"):
        load_replies(spec)


def test_summary_reports_both_shares_and_greedy():
    def m(prefix, reward):
        return {f"{prefix}/reward": reward}

    evals = {
        "base": m("eval_base", 0.0),
        "base_greedy": m("eval_base_greedy", 0.01),
        "before": m("eval_before", 0.3),
        "before_greedy": m("eval_before_greedy", 0.4),
        "after": m("eval_after", 0.6),
        "after_greedy": m("eval_after_greedy", 0.5),
    }
    s = summarize(evals)
    assert s["eval_reward_sft_delta"] == pytest.approx(0.3) and s["eval_reward_delta"] == pytest.approx(0.3)
    assert s["eval_greedy_reward_delta"] == pytest.approx(0.1)
    assert s["eval_greedy_reward_sft_delta"] == pytest.approx(0.39)
    plain = summarize({"before": m("eval_before", 0.3), "after": m("eval_after", 0.5)})
    assert plain == {"eval_reward_before": 0.3, "eval_reward_after": 0.5, "eval_reward_delta": pytest.approx(0.2)}


def test_summary_reports_the_perfect_score_rate():
    evals = {
        when: {f"eval_{when}/reward": r, f"eval_{when}/perfect_frac": p}
        for when, r, p in (("base", 0.1, 0.0), ("before", 0.5, 0.25), ("after", 0.9, 0.75))
    }
    evals["after_greedy"] = {"eval_after_greedy/reward": 1.0, "eval_after_greedy/perfect_frac": 1.0}
    s = summarize(evals)
    assert (s["eval_perfect_base"], s["eval_perfect_before"], s["eval_perfect_after"]) == (0.0, 0.25, 0.75)
    assert s["eval_greedy_perfect_after"] == 1.0 and "eval_greedy_perfect_before" not in s
