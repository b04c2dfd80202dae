"""A user's own training script, written the way TRL's and verifiers' docs show one: the reward functions, their
helpers, a lookup table they close over, a class-based parser and an environment method are defined right here, at
module level, and use what the script imports. tests/e2e/test_own_script.py runs it as

    python own_rewards.py MODEL_DIR OUTPUT_DIR true false

and it trains once per argument after OUTPUT_DIR, with RLConfig.rollout_process set to it, in OUTPUT_DIR/true and
OUTPUT_DIR/false (one interpreter for both: the suite's time). No main guard, as in most such scripts: whatever
ships these functions to the rollout process must not run it again. Every scoring writes a line to scored.jsonl of
its run: which process scored which completion, and how.
"""

import json
import os
import re
import sys

import verifiers as vf
from datasets import Dataset

from verifiers_rl.trainer import RLConfig, RLTrainer

model_dir, output_root, modes = sys.argv[1], sys.argv[2], sys.argv[3:]

WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"]
VOWELS = re.compile(r"[aeiou]")
LETTER_VALUE = {letter: (i % 3) / 2 for i, letter in enumerate("abcdefghijklmnopqrstuvwxyz")}


def text_of(completion) -> str:
    if isinstance(completion, list):
        return (completion[-1]["content"] or "") if completion else ""
    return str(completion)


class FirstWordParser(vf.Parser):
    """The answer is the completion's first run of letters, lower-cased."""

    def parse_answer(self, completion) -> str:
        words = re.findall(r"[a-z]+", text_of(completion).lower())
        return words[0] if words else ""


class VowelCountingEnv(vf.SingleTurnEnv):
    """An environment method of its own, using the globals around it."""

    async def setup_state(self, state) -> None:
        state["answer_vowels"] = len(VOWELS.findall(text_of(state["answer"])))


def has_vowel(completion, **kwargs) -> float:
    return 1.0 if VOWELS.search(text_of(completion)) else 0.0


def letter_score(table):
    def letter_value(completion, **kwargs) -> float:  # closes over the script's lookup table
        text = text_of(completion).lower()
        return sum(table.get(c, 0.0) for c in text) / max(len(text), 1)

    return letter_value


def first_word_match(completion, answer, parser, **kwargs) -> float:
    return float(parser.parse_answer(completion) == answer)


def scored_by(completion, answer, parser, state, **kwargs) -> float:
    """A metric (weight 0): the process that scores, the completion, what the other functions and setup_state say."""
    row = {"pid": os.getpid(), "text": text_of(completion), "has_vowel": has_vowel(completion)}
    row["answer_vowels"] = state.get("answer_vowels")
    row["letter_value"] = letter_score(LETTER_VALUE)(completion)
    row["first_word_match"] = first_word_match(completion, answer, parser)
    with open(SCORED, "a") as f:
        f.write(json.dumps(row) + "\n")
    return 0.0


rows = [{"question": f"Reverse: {w}", "answer": w[::-1]} for w in WORDS]
rubric = vf.Rubric(
    funcs=[has_vowel, letter_score(LETTER_VALUE), first_word_match, scored_by],
    weights=[1.0, 1.0, 1.0, 0.0],
    parser=FirstWordParser(),
)
env = VowelCountingEnv(dataset=Dataset.from_list(rows), rubric=rubric, parser=rubric.parser)

for mode in modes:
    output_dir = os.path.join(output_root, mode)
    SCORED = os.path.join(output_dir, "scored.jsonl")  # read by scored_by when it scores
    args = RLConfig(
        output_dir=output_dir,
        rollout_process=mode == "true",
        rollouts_per_example=4,
        batch_size=16,
        micro_batch_size=8,
        max_steps=2,
        max_async_level=0,  # no batch generated ahead of the last step: both runs score the same rollouts
        max_tokens=6,
        max_seq_len=96,
        max_prompt_len=64,
        learning_rate=5e-3,
        lora_rank=4,
        lora_alpha=8,
        use_cpu=True,
        seed=7,
        save_strategy="no",
        final_model="none",
        log_completions=False,
        server_mode="spawn",
    )
    RLTrainer(model=model_dir, env=env, args=args).train()
print("trainer pid", os.getpid())
