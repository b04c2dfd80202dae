"""alphabet-sort: a multi-turn verifiers environment that teaches a model to keep a sorted list as it grows.

Task. Each episode sorts "First Last" names by FIRST or by LAST name (drawn per episode). Turn 1 gives some
names; each later turn gives new ones. Every turn the assistant must reply with the sorted list of ALL names
seen so far, one per line, each written "First Last", and end each name that is new in this turn with
`` // new name!``, e.g. for last-name order after a second turn that added Alan Turing::

    Ada Lovelace
    Alan Turing // new name!

The episode lasts a planned number of turns (uniform in [min_turns, max_turns]), each giving a planned
number of names (uniform in [min_names_per_turn, max_names_per_turn]); the plan is stored in the example's
``info`` ({"sort_by": "first" | "last", "turns": [[names of turn 1], ...]}), ``env_response`` hands out
the next turn's names, and a stop condition ends the episode after the last planned turn.

Scoring (reward in [0, 1]). For each planned turn, the similarity between the assistant's reply and the
expected reply is the character-level LCS ratio of the two lists, ``2 * LCS / (len(reply) + len(expected))``,
each list written one name per line after stripping and collapsing whitespace and dropping blank lines; a
missing reply (an episode cut short) scores 0. Characters, as upstream's alphabet-sort scores them (difflib's
ratio of the joined lines; the exact LCS here, as reverse-text, has none of difflib's junk heuristics): a name
with one wrong letter still earns most of its line, which is what lets a small model's reward move at all. With
``power_per_turn`` the reward is ``mean(sim_t ** similarity_power)``, otherwise ``mean(sim_t) ** similarity_power``.
A weight-0 metric ``mean_similarity`` is ``mean(sim_t)``.

Teachers (transcripts for ``vf-sft``'s ``[dataset] replies``). ``reference_replies`` answers every turn correctly;
``untagging_teacher_replies`` is a systematically wrong teacher for the tiny demo: on a fixed share of the episodes
(``UNTAGGING_SHARE``, drawn per episode from a hash of its names) it sorts and lists the names right but ignores the
instruction to mark the new ones. A warm-start on its transcripts learns to leave the tag out almost always (one
episode in twenty shows it); only the environment's reward says that the tag belongs there, and that is what RL has
to learn. At 95 % RL's own share of held-out reward is larger than at 85 % or 75 %: the warm-start starts lower and
RL still finds the tag in its samples (docs/performance.md#multi-turn-demo).

Data. Generated offline and deterministically from ``seed`` out of the built-in name lists (no hub).
Within an episode first names are distinct and last names are distinct, so either order is unambiguous;
train and eval episodes are disjoint.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

import verifiers as vf
from datasets import Dataset

NEW_TAG = "// new name!"
FIRST_NAMES = (
    "Ada Alan Alice Amir Anna Bella Boris Carl Chloe Clara Dmitri Edith Elena Emil Farah Felix Grace "
    "Hana Hugo Ines Ivan Jade Jonas Kai Kenji Lara Leo Lina Marco Maya Nadia Nils Noor Olga Omar Paula "
    "Pedro Quinn Rosa Rui Sara Soren Tara Theo Uma Victor Wanda Xavier Yara Zane"
).split()
LAST_NAMES = (
    "Abbott Baker Bauer Chen Costa Dalton Diaz Evans Ferreira Fischer Garcia Gupta Hansen Hughes Ito "
    "Jensen Johnson Kaur Keller Kowalski Larsen Lopez Moreau Muller Nakamura Novak Okafor Olsen Patel "
    "Perez Quinto Rossi Russo Santos Schmidt Silva Tanaka Torres Ueda Usman Varga Vogel Walsh Weber "
    "Xu Yamada Young Zhang Ziegler Zubiri"
).split()


# --- pure functions: expected answers and scoring -------------------------------------------------


def sort_key(name: str, sort_by: str) -> tuple[str, str]:
    first, _, last = name.partition(" ")
    if sort_by not in ("first", "last"):
        raise ValueError(f"sort_by={sort_by!r}; allowed: 'first', 'last'")
    return ((first if sort_by == "first" else last).casefold(), name.casefold())


def expected_lines(turns: Sequence[Sequence[str]], turn: int, sort_by: str) -> list[str]:
    """Expected reply lines at 0-based ``turn``: all names of turns 0..turn, sorted, new ones tagged."""
    new = set(turns[turn])
    names = sorted((n for t in turns[: turn + 1] for n in t), key=lambda n: sort_key(n, sort_by))
    return [f"{n} {NEW_TAG}" if n in new else n for n in names]


def expected_answers(turns: Sequence[Sequence[str]], sort_by: str) -> list[str]:
    """The expected assistant reply for every turn of an episode."""
    return ["\n".join(expected_lines(turns, t, sort_by)) for t in range(len(turns))]


def reference_replies(info: dict) -> list[str]:
    """Every turn's expected reply of an episode, from its ``info`` (what ``vf-sft``'s ``[dataset] replies`` calls
    to build warm-start transcripts)."""
    return expected_answers(info["turns"], info["sort_by"])


UNTAGGING_SHARE = 0.95


def untagging_teacher_replies(info: dict) -> list[str]:
    """The reference replies, except on ``UNTAGGING_SHARE`` of the episodes, where every turn's new names go
    untagged (the same names in the same order). Drawn from a hash of the episode, not a random stream, so an
    episode's transcript does not depend on which episodes were drawn before it."""
    key = f"{info['sort_by']}:{info['turns']}".encode()
    replies = reference_replies(info)
    if zlib.crc32(key) % 10_000 < UNTAGGING_SHARE * 10_000:
        return [reply.replace(f" {NEW_TAG}", "") for reply in replies]
    return replies


def reply_lines(text: str) -> list[str]:
    """Non-blank lines of a reply, stripped, with runs of whitespace collapsed to one space."""
    return [" ".join(line.split()) for line in (text or "").splitlines() if line.strip()]


def lcs_length(a: Sequence, b: Sequence) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def turn_similarity(reply: str, expected: str) -> float:
    """Character-level LCS ratio between a reply and the expected reply, both normalised to one name per line
    (1.0 = identical lists)."""
    a, b = "\n".join(reply_lines(reply)), "\n".join(reply_lines(expected))
    if not a and not b:
        return 1.0
    return 2.0 * lcs_length(a, b) / (len(a) + len(b))


def aggregate(similarities: Sequence[float], power: float, power_per_turn: bool) -> float:
    """``mean(s ** power)`` if ``power_per_turn`` else ``mean(s) ** power`` (0.0 for no turns)."""
    if not similarities:
        return 0.0
    if power_per_turn:
        return sum(s**power for s in similarities) / len(similarities)
    return (sum(similarities) / len(similarities)) ** power


def turn_similarities(replies: Sequence[str], turns: Sequence[Sequence[str]], sort_by: str) -> list[float]:
    """Similarity of each planned turn; replies past the plan are ignored, missing ones score 0."""
    answers = expected_answers(turns, sort_by)
    return [turn_similarity(replies[t], answers[t]) if t < len(replies) else 0.0 for t in range(len(turns))]


def _field(obj, key):
    return obj.get(key) if hasattr(obj, "get") else getattr(obj, key, None)


def assistant_replies(completion) -> list[str]:
    """Text of every assistant message of a completion, in order."""
    if isinstance(completion, str):
        return [completion]
    out = []
    for message in completion or []:
        if _field(message, "role") == "assistant":
            content = _field(message, "content") or ""
            if isinstance(content, list):
                content = "".join(_field(p, "text") or "" for p in content)
            out.append(content)
    return out


# --- prompts and data ------------------------------------------------------------------------------


def turn_message(turn: int, names: Sequence[str], sort_by: str) -> str:
    """The user message of 0-based ``turn``: the instructions (short after turn 1), then the new names."""
    key = sort_by.upper()
    if turn == 0:
        head = (
            f"Sort these names alphabetically by {key} name. Reply with the sorted list only, one name "
            f"per line, and end each name that is new this turn with ' {NEW_TAG}'."
        )
    else:
        head = f"New names. Reply with ALL names so far sorted by {key} name, new ones ending with ' {NEW_TAG}'."
    return head + "\n\n" + "\n".join(names)


def make_episode(rng: random.Random, min_turns: int, max_turns: int, min_names: int, max_names: int) -> dict:
    sort_by = rng.choice(["first", "last"])
    counts = [rng.randint(min_names, max_names) for _ in range(rng.randint(min_turns, max_turns))]
    firsts = rng.sample(FIRST_NAMES, sum(counts))
    lasts = rng.sample(LAST_NAMES, sum(counts))
    names = [f"{first} {last}" for first, last in zip(firsts, lasts)]
    turns, i = [], 0
    for c in counts:
        turns.append(names[i : i + c])
        i += c
    return {"sort_by": sort_by, "turns": turns}


def make_rows(n: int, min_turns: int, max_turns: int, min_names: int, max_names: int, seed: int) -> list[dict]:
    """``n`` distinct episodes as dataset rows (prompt, answer = last turn's expected reply, info)."""
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    if not 1 <= min_names <= max_names:
        raise ValueError(f"need 1 <= min_names_per_turn <= max_names_per_turn, got {min_names}, {max_names}")
    most = min(len(FIRST_NAMES), len(LAST_NAMES))
    if max_turns * max_names > most:
        raise ValueError(f"max_turns * max_names_per_turn = {max_turns * max_names} > {most} built-in names")
    rng, rows, seen = random.Random(seed), [], set()
    for _ in range(100 * n + 1000):
        if len(rows) == n:
            break
        ep = make_episode(rng, min_turns, max_turns, min_names, max_names)
        key = (ep["sort_by"], tuple(tuple(t) for t in ep["turns"]))
        if key in seen:
            continue
        seen.add(key)
        rows.append(
            {
                "prompt": [{"role": "user", "content": turn_message(0, ep["turns"][0], ep["sort_by"])}],
                "answer": expected_answers(ep["turns"], ep["sort_by"])[-1],
                "info": ep,
            }
        )
    if len(rows) < n:
        raise ValueError(f"could only draw {len(rows)} distinct episodes of {n}; widen the turn/name ranges")
    return rows


class AlphabetSortEnv(vf.MultiTurnEnv):
    """Gives the next planned turn's names after each reply; stops after the last planned turn."""

    async def env_response(self, messages, state, **kwargs):
        info, turn = state["info"], len(state["trajectory"])
        return [vf.UserMessage(content=turn_message(turn, info["turns"][turn], info["sort_by"]))]

    @vf.stop
    async def all_turns_answered(self, state) -> bool:
        return len(state["trajectory"]) >= len(state["info"]["turns"])


def make_rubric(similarity_power: float, power_per_turn: bool) -> vf.Rubric:
    def alphabet_sort_reward(completion, info) -> float:
        sims = turn_similarities(assistant_replies(completion), info["turns"], info["sort_by"])
        return aggregate(sims, similarity_power, power_per_turn)

    def mean_similarity(completion, info) -> float:
        return aggregate(turn_similarities(assistant_replies(completion), info["turns"], info["sort_by"]), 1.0, True)

    return vf.Rubric(funcs=[alphabet_sort_reward, mean_similarity], weights=[1.0, 0.0])


def load_environment(
    num_train_examples: int = 2000,
    num_eval_examples: int = 200,
    min_turns: int = 1,
    max_turns: int = 3,
    min_names_per_turn: int = 1,
    max_names_per_turn: int = 4,
    similarity_power: float = 4.0,
    power_per_turn: bool = True,
    seed: int = 0,
    system_prompt: str | None = None,
    **kwargs,
) -> AlphabetSortEnv:
    """The alphabet-sort environment (see the module docstring); extra kwargs go to the env."""
    rows = make_rows(
        num_train_examples + num_eval_examples, min_turns, max_turns, min_names_per_turn, max_names_per_turn, seed
    )
    train, evaluation = rows[:num_train_examples], rows[num_train_examples:]
    return AlphabetSortEnv(
        dataset=Dataset.from_list(train) if train else None,
        eval_dataset=Dataset.from_list(evaluation) if evaluation else None,
        system_prompt=system_prompt,
        rubric=make_rubric(similarity_power, power_per_turn),
        max_turns=max_turns,
        **kwargs,
    )
