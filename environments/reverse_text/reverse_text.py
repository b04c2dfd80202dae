"""reverse-text: a single-turn verifiers environment that teaches a model to reverse a text.

Task. The user message is a short text; the model must answer with the same text reversed character
by character, inside one XML field: ``abc`` -> ``<reversed_text>cba</reversed_text>`` (the format the
``configs/vf-sft/reverse-text.toml`` warm-start writes). A tiny byte-level model pays one token per tag
character, so the reward does not require the tags (see the fallback below).

Scoring (reward in [0, 1], weight 1): the LCS ratio ``2 * LCS(pred, target) / (len(pred) + len(target))``
between the predicted text and the reversed text, where LCS is the length of the longest common
subsequence of characters. A perfect answer scores 1.0, an empty one 0.0, and near misses get partial
credit, so a model that is partly right still gets a learning signal.

Fallback: ``pred`` is the content of the last ``<reversed_text>...</reversed_text>`` pair in the last
assistant message. When that message has no complete pair (the model forgot the tags, or ran out of tokens
before closing them), ``pred`` is the whole message text with any stray opening/closing tags removed, so a
model that has not learned the format yet still gets credit for the characters it got right.
A weight-0 metric, ``has_tag``, reports whether the tags were used.

Data. Generated offline and deterministically from ``seed`` (no hub): ``unit="char"`` (default) draws
texts of ``min_len``..``max_len`` characters from ``alphabet``, sized for a tiny model; ``unit="word"``
draws sentences of ``min_len``..``max_len`` words from ``words`` (a built-in list of common English
words by default) for a more realistic task. Texts are unique, and train/eval are disjoint. Each row's ``info``
holds its text (``{"text": ...}``), which is what a transcript function for ``vf-sft`` reads.

Teachers. ``reference_replies`` answers every text correctly; ``lazy_teacher_replies`` is a systematically wrong
teacher for the tiny learning demo: on a fixed share of the texts (``LAZY_SHARE``, drawn per text from its hash, so
a text always gets the same answer) it copies the text instead of reversing it. A warm-start on its transcripts
learns both answers, and only the environment's reward says which one is right: what RL has to find.
"""

from __future__ import annotations

import itertools
import random
import re
import zlib
from collections.abc import Sequence

import verifiers as vf
from datasets import Dataset

ANSWER_TAG = "reversed_text"
DEFAULT_SYSTEM_PROMPT = (
    "Reverse the text character by character. Reply as <reversed_text>reversed text</reversed_text>."
)
DEFAULT_ALPHABET = "abcdefgh"
WORDS = (
    "the a of and to in is it on for was with as his that he by at from this had not are but "
    "be or have an they which one you were her all she there would their we him been has when who "
    "will more no if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come since "
    "against go came right used take three house light river stone paper green small cold bright"
).split()

_TAG_RE = re.compile(rf"</?{ANSWER_TAG}>")


# --- pure scoring functions ----------------------------------------------------------------------


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a)*len(b)) DP, one row)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(a: Sequence, b: Sequence) -> float:
    """``2 * LCS(a, b) / (len(a) + len(b))``: 1.0 for equal sequences (two empty ones included)."""
    if not a and not b:
        return 1.0
    return 2.0 * lcs_length(a, b) / (len(a) + len(b))


def _message_text(message) -> str:
    content = message.get("content") if hasattr(message, "get") else getattr(message, "content", "")
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") if hasattr(p, "get") else getattr(p, "text", "") for p in content)
    return content or ""


def last_assistant_text(completion) -> str:
    """Text of the last assistant message (a plain string completion is returned as is)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion or []):
        if (message.get("role") if hasattr(message, "get") else getattr(message, "role", None)) == "assistant":
            return _message_text(message)
    return ""


def extract_reversed(text: str, parser: vf.XMLParser | None = None) -> tuple[str, bool]:
    """``(prediction, tagged)``: the last tagged field, else the tag-stripped text (the fallback)."""
    parser = parser or make_parser()
    field = getattr(parser.parse(text, last=True), ANSWER_TAG, None)
    if field is not None:
        return field, True
    return _TAG_RE.sub("", text).strip(), False


def score_reversal(text: str, target: str, parser: vf.XMLParser | None = None) -> float:
    """LCS ratio between the answer extracted from ``text`` and ``target``."""
    return lcs_ratio(extract_reversed(text, parser)[0], target)


def make_parser() -> vf.XMLParser:
    return vf.XMLParser([ANSWER_TAG], answer_field=ANSWER_TAG)


# Reward functions: verifiers passes the named arguments they ask for.
def lcs_reward(completion, answer, parser) -> float:
    """LCS ratio of the (tagged or fallback) answer against the reversed text."""
    return score_reversal(last_assistant_text(completion), answer, parser)


def has_tag(completion, parser) -> float:
    """1.0 when the last assistant message has a complete <reversed_text>...</reversed_text> pair (metric)."""
    return float(extract_reversed(last_assistant_text(completion), parser)[1])


# --- data ------------------------------------------------------------------------------------------


def _capacity(n_symbols: int, min_len: int, max_len: int) -> int:
    return sum(n_symbols**k for k in range(min_len, max_len + 1))


def generate_texts(n: int, min_len: int, max_len: int, symbols: Sequence[str], sep: str, seed: int) -> list[str]:
    """``n`` distinct texts of ``min_len``..``max_len`` symbols joined by ``sep``, fixed by ``seed``."""
    symbols = list(dict.fromkeys(symbols))  # dedupe, keep order
    if not symbols:
        raise ValueError("the alphabet / word list is empty")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    capacity = _capacity(len(symbols), min_len, max_len)
    if n > capacity:
        raise ValueError(
            f"asked for {n} distinct texts but only {capacity} exist with {len(symbols)} symbols "
            f"and lengths {min_len}..{max_len}; widen the alphabet or the lengths"
        )
    rng = random.Random(seed)
    if capacity <= 2 * n:  # nearly exhaustive: enumerate, then sample (rejection would crawl)
        every = [sep.join(t) for k in range(min_len, max_len + 1) for t in itertools.product(symbols, repeat=k)]
        return rng.sample(every, n)
    seen: dict[str, None] = {}
    while len(seen) < n:
        k = rng.randint(min_len, max_len)
        seen.setdefault(sep.join(rng.choice(symbols) for _ in range(k)), None)
    return list(seen)


def build_rows(texts: Sequence[str]) -> list[dict]:
    return [{"question": t, "answer": t[::-1], "info": {"text": t}} for t in texts]


# --- teachers: transcripts for vf-sft's [dataset] replies ----------------------------------------------

LAZY_SHARE = 0.6


def reference_replies(info: dict) -> list[str]:
    """The correct reply to a text (one turn), from its row's ``info``."""
    return [f"<{ANSWER_TAG}>{info['text'][::-1]}</{ANSWER_TAG}>"]


def drawn(key: str, share: float) -> bool:
    """True for a fixed ``share`` of keys: a hash, not a random stream, so a transcript does not depend on which
    rows were drawn before it (SFT's row count or order)."""
    return zlib.crc32(key.encode()) % 10_000 < share * 10_000


def lazy_teacher_replies(info: dict) -> list[str]:
    """The reference reply, except on ``LAZY_SHARE`` of the texts, where the teacher copies the text unreversed: the
    format right, the content what a lazy annotator writes. Copying scores the LCS of a text with its reverse
    (~0.4 for 3-8 random letters), so the reward tells the two answers apart and no transcript says which is right."""
    text = info["text"]
    return [f"<{ANSWER_TAG}>{text}</{ANSWER_TAG}>"] if drawn(text, LAZY_SHARE) else reference_replies(info)


def make_splits(
    num_train_examples: int,
    num_eval_examples: int,
    min_len: int,
    max_len: int,
    alphabet: str,
    unit: str,
    words: Sequence[str] | None,
    seed: int,
) -> tuple[list[dict], list[dict]]:
    """Train and eval rows from one stream of distinct texts, so the two splits never overlap."""
    if unit == "char":
        symbols, sep = list(alphabet), ""
    elif unit == "word":
        symbols, sep = list(words or WORDS), " "
    else:
        raise ValueError(f"unit={unit!r}; allowed: 'char', 'word'")
    texts = generate_texts(num_train_examples + num_eval_examples, min_len, max_len, symbols, sep, seed)
    return build_rows(texts[:num_train_examples]), build_rows(texts[num_train_examples:])


def load_environment(
    num_train_examples: int = 2000,
    num_eval_examples: int = 200,
    min_len: int = 3,
    max_len: int = 8,
    alphabet: str = DEFAULT_ALPHABET,
    unit: str = "char",
    words: list[str] | None = None,
    seed: int = 0,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    **kwargs,
) -> vf.SingleTurnEnv:
    """The reverse-text environment; ``min_len``/``max_len`` count characters (``unit="char"``) or words
    (``unit="word"``, e.g. ``min_len=5, max_len=12`` for realistic sentences). Extra kwargs go to the env."""
    train, evaluation = make_splits(
        num_train_examples, num_eval_examples, min_len, max_len, alphabet, unit, words, seed
    )
    parser = make_parser()
    rubric = vf.Rubric(funcs=[lcs_reward, has_tag], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(train) if train else None,
        eval_dataset=Dataset.from_list(evaluation) if evaluation else None,
        system_prompt=system_prompt,
        parser=parser,
        rubric=rubric,
        **kwargs,
    )
