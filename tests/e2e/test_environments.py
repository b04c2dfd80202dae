"""The packaged environments (environments/reverse_text, environments/alphabet_sort): data, scoring, and real
rollouts against our CPU inference server, through `env.generate` and through verifiers' own `vf-eval` CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import alphabet_sort as asort
import pytest
import reverse_text as rt
import verifiers as vf
from openai import AsyncOpenAI

from verifiers_rl.serving.launcher import InferenceServer


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _score(env, row, completion) -> vf.State:
    """Score a hand-written completion with the env's full rubric, as verifiers does after a rollout."""
    state = vf.State(input={k: row[k] for k in ("prompt", "answer", "info", "example_id") if k in row})
    n_replies = sum(1 for m in completion if m["role"] == "assistant")
    state.update(prompt=row["prompt"], completion=completion, trajectory=[{}] * n_replies, reward=None, metrics=None)
    asyncio.run(env.rubric.score_rollout(state))
    return state


# --- reverse-text ----------------------------------------------------------------------------------


def test_reverse_text_loads_through_verifiers():
    env = vf.load_environment("reverse-text")
    assert isinstance(env, vf.SingleTurnEnv)
    train, evaluation = env.get_dataset(), env.get_eval_dataset()
    assert (len(train), len(evaluation)) == (2000, 200)
    row = train[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "<reversed_text>" in row["prompt"][0]["content"]
    assert row["prompt"][1]["content"] == row["question"] and row["answer"] == row["question"][::-1]
    for q in train["question"]:
        assert 3 <= len(q) <= 8 and set(q) <= set(rt.DEFAULT_ALPHABET)


def test_reverse_text_data_is_seeded_and_splits_are_disjoint():
    a = rt.load_environment(num_train_examples=300, num_eval_examples=100, seed=1)
    b = rt.load_environment(num_train_examples=300, num_eval_examples=100, seed=1)
    c = rt.load_environment(num_train_examples=300, num_eval_examples=100, seed=2)

    def q(env, split="train"):
        return list((env.get_dataset() if split == "train" else env.get_eval_dataset())["question"])

    assert q(a) == q(b) and q(a, "eval") == q(b, "eval")
    assert q(a) != q(c)
    train, evaluation = set(a.get_dataset()["question"]), set(a.get_eval_dataset()["question"])
    assert len(train) == 300 and len(evaluation) == 100 and not train & evaluation

    words = rt.load_environment(num_train_examples=20, num_eval_examples=5, unit="word", min_len=5, max_len=9)
    for row in words.get_dataset():
        assert 5 <= len(row["question"].split(" ")) <= 9 and row["answer"] == row["question"][::-1]


def test_reverse_text_exhaustive_and_impossible_sizes():
    env = rt.load_environment(num_train_examples=3, num_eval_examples=1, alphabet="ab", min_len=2, max_len=2)
    texts = list(env.get_dataset()["question"]) + list(env.get_eval_dataset()["question"])
    assert sorted(texts) == ["aa", "ab", "ba", "bb"]
    with pytest.raises(ValueError, match="distinct texts"):
        rt.load_environment(num_train_examples=4, num_eval_examples=1, alphabet="ab", min_len=2, max_len=2)
    with pytest.raises(ValueError, match="unit"):
        rt.load_environment(unit="sentence")


def test_lcs_by_hand():
    assert rt.lcs_length("ABCBDAB", "BDCABA") == 4  # the textbook example (BCBA)
    assert rt.lcs_length("abcd", "acbd") == 3
    assert rt.lcs_length("", "abc") == 0
    assert rt.lcs_ratio("abc", "abc") == 1.0
    assert rt.lcs_ratio("abcd", "acbd") == 0.75  # 2*3/8
    assert rt.lcs_ratio("ab", "abcd") == pytest.approx(2 * 2 / 6)
    assert rt.lcs_ratio("xyz", "abc") == 0.0
    assert rt.lcs_ratio("", "abc") == 0.0 and rt.lcs_ratio("", "") == 1.0
    # LCS, not difflib's matching blocks: "abxcd" vs "acd" shares a c d -> 2*3/8
    assert rt.lcs_ratio("abxcd", "acd") == 0.75


def test_reverse_text_reward_by_hand():
    env = rt.load_environment(num_train_examples=4, num_eval_examples=1)
    row = {"prompt": [_user("abc")], "answer": "cba", "info": {}, "example_id": 0}

    def score(text):
        state = _score(env, row, [_assistant(text)])
        return state["reward"], state["metrics"]["lcs_reward"], state["metrics"]["has_tag"]

    def tag(text):
        return f"<reversed_text>{text}</reversed_text>"

    assert score(tag("cba")) == (1.0, 1.0, 1.0)
    assert score(tag("\ncba\n")) == (1.0, 1.0, 1.0)  # XMLParser strips the field
    assert score("cba") == (1.0, 1.0, 0.0)  # tag missing: the raw text is scored
    assert score("<reversed_text>cb") == (0.8, 0.8, 0.0)  # unclosed: stray tag removed, "cb" vs "cba" = 4/5
    assert score(f"{tag('x')} then {tag('cab')}")[0] == pytest.approx(2 * 2 / 6)  # the last field counts
    assert score("") == (0.0, 0.0, 0.0)
    assert score(tag("")) == (0.0, 0.0, 1.0)
    # verifiers' own message objects, as a real rollout's completion holds them, and plain-text completions
    assert rt.lcs_reward([vf.AssistantMessage(content=tag("cba"))], "cba", rt.make_parser()) == 1.0
    assert rt.lcs_reward(tag("cba"), "cba", rt.make_parser()) == 1.0


# --- alphabet-sort ---------------------------------------------------------------------------------

TURNS = [["Ada Zubiri", "Zane Abbott"], ["Maya Moreau"], ["Kai Chen"]]
NEW = " // new name!"


def test_alphabet_sort_expected_answers_by_hand():
    assert asort.expected_answers(TURNS[:2], "first") == [
        f"Ada Zubiri{NEW}\nZane Abbott{NEW}",
        f"Ada Zubiri\nMaya Moreau{NEW}\nZane Abbott",
    ]
    assert asort.expected_answers(TURNS, "last") == [
        f"Zane Abbott{NEW}\nAda Zubiri{NEW}",
        f"Zane Abbott\nMaya Moreau{NEW}\nAda Zubiri",
        f"Zane Abbott\nKai Chen{NEW}\nMaya Moreau\nAda Zubiri",
    ]
    assert asort.expected_lines(TURNS, 2, "first") == ["Ada Zubiri", f"Kai Chen{NEW}", "Maya Moreau", "Zane Abbott"]


def test_alphabet_sort_similarity_and_aggregation_by_hand():
    assert asort.turn_similarity("  Zane   Abbott \n\nAda Zubiri\n", "Zane Abbott\nAda Zubiri") == 1.0
    # characters of the lists as lines: a missing line costs its characters (2*22/(22+34)), a misspelt name little
    assert asort.turn_similarity("Zane Abbott\nAda Zubiri", "Zane Abbott\nMaya Moreau\nAda Zubiri") == 44 / 56
    assert asort.turn_similarity("Zane Abbot\nAda Zubiri", "Zane Abbott\nAda Zubiri") == 42 / 43
    assert asort.turn_similarity("Ada Zubiri\nZane Abbott", "Zane Abbott\nAda Zubiri") == 0.5  # LCS: Zane Abbott
    assert asort.turn_similarity("", "Zane Abbott") == 0.0
    assert asort.aggregate([1.0, 0.8, 0.0], 2.0, True) == pytest.approx((1 + 0.64 + 0) / 3)
    assert asort.aggregate([1.0, 0.8, 0.0], 2.0, False) == pytest.approx(0.6**2)
    assert asort.turn_similarities(["x"], TURNS, "last") == [0.0, 0.0, 0.0]  # missing replies score 0


def test_alphabet_sort_loads_and_data_is_seeded_and_disjoint():
    kw = dict(
        min_turns=3,
        max_turns=3,
        min_names_per_turn=1,
        max_names_per_turn=3,
        num_train_examples=200,
        num_eval_examples=50,
    )
    env = vf.load_environment("alphabet-sort", seed=5, **kw)
    assert isinstance(env, asort.AlphabetSortEnv) and isinstance(env, vf.MultiTurnEnv)
    again, other = asort.load_environment(seed=5, **kw), asort.load_environment(seed=6, **kw)
    train, evaluation = env.get_dataset(), env.get_eval_dataset()
    assert (len(train), len(evaluation)) == (200, 50)
    assert list(train["info"]) == list(again.get_dataset()["info"])
    assert list(evaluation["info"]) == list(again.get_eval_dataset()["info"])
    assert list(train["info"]) != list(other.get_dataset()["info"])
    key = lambda info: json.dumps(info, sort_keys=True)  # noqa: E731
    assert not {key(i) for i in train["info"]} & {key(i) for i in evaluation["info"]}
    assert {i["sort_by"] for i in train["info"]} == {"first", "last"}
    for row in train:
        info = row["info"]
        assert len(info["turns"]) == 3 and all(1 <= len(t) <= 3 for t in info["turns"])
        names = [n for t in info["turns"] for n in t]
        assert len({n.split()[0] for n in names}) == len({n.split()[1] for n in names}) == len(names)
        assert row["prompt"][0]["content"].endswith("\n".join(info["turns"][0]))
        assert f"by {info['sort_by'].upper()} name" in row["prompt"][0]["content"]
        assert row["answer"] == asort.expected_answers(info["turns"], info["sort_by"])[-1]
    lengths = {len(i["turns"]) for i in asort.load_environment(min_turns=1, max_turns=3).get_dataset()["info"]}
    assert lengths == {1, 2, 3}
    with pytest.raises(ValueError):
        asort.load_environment(max_turns=20, max_names_per_turn=5)  # more names than the built-in lists


def test_alphabet_sort_env_response_and_stop():
    env = asort.load_environment(num_train_examples=2, num_eval_examples=1)
    state = vf.State(input={"info": {"sort_by": "last", "turns": TURNS}, "prompt": [], "example_id": 0})
    state["trajectory"] = [{}]
    [msg] = asyncio.run(env.env_response([], state))
    assert msg["role"] == "user" and msg["content"].endswith("Maya Moreau") and "by LAST name" in msg["content"]
    assert not asyncio.run(env.all_turns_answered(state))
    state["trajectory"] = [{}] * 3
    assert asyncio.run(env.all_turns_answered(state))


def test_demo_teachers_are_wrong_on_a_fixed_share_and_right_elsewhere():
    """The learning demos warm-start on these teachers' transcripts: each is wrong in one systematic way on a fixed
    share of the items, right on the rest, and gives an item the same transcript whatever else was drawn."""
    texts = rt.generate_texts(3000, 3, 8, rt.DEFAULT_ALPHABET, "", 0)
    lazy = [rt.lazy_teacher_replies({"text": t}) for t in texts]
    wrong = [rt.drawn(t, rt.LAZY_SHARE) for t in texts]
    for t, reply, w in zip(texts, lazy, wrong):
        assert reply == ([f"<reversed_text>{t}</reversed_text>"] if w else rt.reference_replies({"text": t}))
    assert sum(wrong) / len(texts) == pytest.approx(rt.LAZY_SHARE, abs=0.03)
    assert rt.build_rows(["abc"])[0]["info"] == {"text": "abc"}  # what the teacher reads
    infos = [row["info"] for row in asort.make_rows(3000, 2, 3, 1, 2, 0)]
    untagged = 0
    for info in infos:
        reference, teacher = asort.reference_replies(info), asort.untagging_teacher_replies(info)
        assert [r.replace(NEW, "") for r in reference] == [r.replace(NEW, "") for r in teacher]  # same names, order
        assert teacher == reference or not any(NEW in r for r in teacher)  # untagged: the whole episode
        untagged += teacher != reference
        assert asort.untagging_teacher_replies(json.loads(json.dumps(info))) == teacher
    assert untagged / len(infos) == pytest.approx(asort.UNTAGGING_SHARE, abs=0.03)


@pytest.mark.parametrize("power_per_turn", [True, False])
def test_alphabet_sort_rubric_scores_conversations(power_per_turn):
    env = asort.load_environment(
        num_train_examples=2, num_eval_examples=1, similarity_power=2.0, power_per_turn=power_per_turn
    )
    info = {"sort_by": "last", "turns": TURNS}
    row = {"prompt": [_user(asort.turn_message(0, TURNS[0], "last"))], "answer": "", "info": info, "example_id": 0}
    answers = asort.expected_answers(TURNS, "last")
    perfect = [_assistant(answers[0]), _user("t2"), _assistant(answers[1]), _user("t3"), _assistant(answers[2])]
    state = _score(env, row, perfect)
    assert state["reward"] == 1.0 and state["metrics"]["mean_similarity"] == 1.0
    assert state["metrics"]["num_turns"] == 3
    # turn 1 right, turn 2 misses Maya's line (22 of the expected 47 characters: 2*22/69), turn 3 empty (0.0)
    wrong = [_assistant(answers[0]), _user("t2"), _assistant("Zane Abbott\nAda Zubiri"), _user("t3"), _assistant("")]
    assert len(answers[1]) == 47
    s2 = 2 * 22 / 69
    state = _score(env, row, wrong)
    assert state["reward"] == pytest.approx((1 + s2**2) / 3 if power_per_turn else ((1 + s2) / 3) ** 2)
    assert state["metrics"]["mean_similarity"] == pytest.approx((1 + s2) / 3)
    cut_short = _score(env, row, perfect[:3])  # an episode that ended after two turns: turn 3 scores 0
    assert cut_short["reward"] == pytest.approx(2 / 3 if power_per_turn else (2 / 3) ** 2)


# --- end to end against the CPU inference server ---------------------------------------------------


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory):
    with InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path_factory.mktemp("env-server")) as client:
        yield client.base_url + "/v1"


def _generate(env, inputs, url, model):
    client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=url, api_key="x"))
    # ignore_eos: a random tiny model sometimes ends at once, which verifiers records as an EmptyModelResponseError
    sampling = {"max_tokens": 16, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    return asyncio.run(env.generate(inputs, client, model=model, sampling_args=sampling))["outputs"]


def test_reverse_text_generate_end_to_end(server_url, tiny_model_dir):
    env = vf.load_environment("reverse-text", num_train_examples=8, num_eval_examples=4)
    outputs = _generate(env, env.get_eval_dataset().repeat(2), server_url, tiny_model_dir)
    assert len(outputs) == 8
    for out in outputs:
        assert out["error"] is None and out["is_completed"]
        assert [m["role"] for m in out["completion"]] == ["assistant"]
        assert 0.0 <= out["reward"] <= 1.0 and out["reward"] == out["metrics"]["lcs_reward"]


def test_alphabet_sort_generate_end_to_end(server_url, tiny_model_dir):
    env = vf.load_environment(
        "alphabet-sort",
        min_turns=3,
        max_turns=3,
        min_names_per_turn=1,
        max_names_per_turn=2,
        num_train_examples=4,
        num_eval_examples=3,
    )
    outputs = _generate(env, env.get_eval_dataset().repeat(2), server_url, tiny_model_dir)
    assert len(outputs) == 6
    for out in outputs:
        assert out["error"] is None and out["is_completed"]
        assert out["stop_condition"] == "all_turns_answered"
        assert len(out["info"]["turns"]) == out["metrics"]["num_turns"] == 3
        assert [m["role"] for m in out["completion"]] == ["assistant", "user"] * 2 + ["assistant"]
        assert out["completion"][3]["content"].endswith("\n".join(out["info"]["turns"][2]))
        assert 0.0 <= out["reward"] <= 1.0


# Loaded by every Python process vf-eval starts (PYTHONPATH): records and refuses non-loopback connects.
_NO_NETWORK = """
import ipaddress, os, socket
_connect = socket.socket.connect
def _guard(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        host = address[0]
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = host == "localhost"
        if not ok:
            with open(os.environ["VF_TEST_NET_LOG"], "a") as f:
                f.write(f"{host}\\n")
            raise OSError(f"vf-eval tried to reach the network ({host})")
    return _connect(self, address)
socket.socket.connect = _guard
"""


VF_EVAL_CASES = [
    # single-turn is -m slow for CI time: the multi-turn case runs the same CLI path and the environment's turns
    pytest.param(
        "reverse-text", {"num_train_examples": 8, "num_eval_examples": 4}, 1, marks=pytest.mark.slow, id="reverse-text"
    ),
    pytest.param(
        "alphabet-sort",
        {"num_train_examples": 4, "num_eval_examples": 2, "min_turns": 2, "max_turns": 2},
        2,
        id="alphabet-sort",
    ),
]


@pytest.mark.parametrize("env_id, env_args, turns", VF_EVAL_CASES)
def test_vf_eval_cli(server_url, tiny_model_dir, tmp_path, env_id, env_args, turns):
    """verifiers' own CLI, env server and all, against our server; no process it starts may leave loopback."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(textwrap.dedent(_NO_NETWORK))
    net_log = tmp_path / "network.log"
    env = {**os.environ, "PYTHONPATH": str(guard), "VF_TEST_NET_LOG": str(net_log), "VF_TEST_KEY": "x"}
    out_dir = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "verifiers.scripts.eval",
        env_id,
        "-m",
        tiny_model_dir,
        "-b",
        server_url,
        "-k",
        "VF_TEST_KEY",
        "-n",
        "2",
        "-r",
        "2",
        "-t",
        "16",
        "-T",
        "1.0",
        "-S",  # seeded: an unseeded random tiny model answers EOS first now and then (EmptyModelResponseError)
        json.dumps({"seed": 7}),
        "-a",
        json.dumps(env_args),
        "-d",
        "-s",
        "-o",
        str(out_dir),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not net_log.exists(), net_log.read_text()
    [results] = list(out_dir.rglob("results.jsonl"))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 4 and sorted(r["example_id"] for r in rows) == [0, 0, 1, 1]
    for r in rows:
        assert r["error"] is None and 0.0 <= r["reward"] <= 1.0 and r["metrics"]["num_turns"] == turns
