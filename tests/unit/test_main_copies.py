"""What the rollout process gets of functions defined in the user's `__main__` (main_copies.copy_of /
load_copy): a script's functions, run in another interpreter, give what they give in the script, whatever shape
their globals take. Both sides are real interpreters whose `__main__` is a `python -c` namespace, as for the
rollout process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, re, sys
    from functools import partial

    from verifiers_rl.rollouts.main_copies import copy_of

    VOWELS = re.compile(r"[aeiou]")
    calls = 0

    @dataclasses.dataclass
    class Weights:
        vowel: float = 0.5

    WEIGHTS = Weights()

    def is_even(n):  # helpers that call each other (dill's own `recurse` overflows the stack on these)
        return True if n == 0 else is_odd(n - 1)

    def is_odd(n):
        return False if n == 0 else is_even(n - 1)

    def count():  # rebinds a global that another function reads: one namespace, as in the script
        global calls
        calls += 1

    class Base:
        def parse(self, text):
            return text.strip()

    class Parser(Base):
        def parse(self, text):
            return VOWELS.sub("", super().parse(text))

    def scaled(table):
        def by_table(text):
            return sum(table.get(c, 0) for c in text)
        return by_table

    def score(text, parser, extra):
        count()
        return [len(VOWELS.findall(text)) * WEIGHTS.vowel, is_even(len(text)), parser.parse(text), extra(text), calls]

    funcs = [partial(score, parser=Parser(), extra=scaled({"a": 1, "b": 2})), lambda text: [calls, is_odd(3)]]

    def run(funcs):
        return [f(t) for t in ("  abba ", "xyz") for f in funcs]

    if sys.argv[1] == "copy":
        open(sys.argv[2], "wb").write(copy_of(funcs))
        print(json.dumps(run(funcs)))
    """
)

LOAD = textwrap.dedent(
    """
    import json, sys
    from verifiers_rl.rollouts.main_copies import load_copy

    funcs = load_copy(open(sys.argv[1], "rb").read())
    print(json.dumps([f(t) for t in ("  abba ", "xyz") for f in funcs]))
    """
)


def test_a_scripts_functions_give_in_another_interpreter_what_they_give_in_the_script(tmp_path):
    payload = tmp_path / "funcs.dill"
    here = subprocess.run([sys.executable, "-c", SCRIPT, "copy", str(payload)], capture_output=True, text=True)
    assert here.returncode == 0, here.stderr[-3000:]
    there = subprocess.run([sys.executable, "-c", LOAD, str(payload)], capture_output=True, text=True)
    assert there.returncode == 0, there.stderr[-3000:]
    expected = [[1.0, False, "bb", 6, 1], [1, True], [0.0, False, "xyz", 0, 2], [2, True]]
    assert json.loads(here.stdout) == expected
    assert json.loads(there.stdout) == expected
