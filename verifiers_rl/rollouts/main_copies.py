"""What the rollout process gets of the user's `__main__` (a training script run as `python script.py`, a
notebook's cells): their functions work there as in the trainer's process.

dill copies a function of `__main__` by value, but its globals by reference to `__main__`, which in the rollout
process is not the user's: the function's first use of `re` or of a helper of the script would be a NameError. So
the globals such functions read follow the environment into the child's own `__main__` (the child is a `python -c`
process: its own code lives elsewhere), and with them the globals that their own functions read, and so on. The
functions share that one namespace, as in the script: a global that one helper rebinds is seen by the others, and
helpers that call each other work (dill's own `recurse` mode gives each function a private copy of its globals and
overflows the stack on such helpers). Functions of importable modules cross by reference, as before. The user's
script is never run again: it has no main guard, as a rule, and would train a second time.
"""

from __future__ import annotations

import dis
import io
import sys
import types


def copy_of(env) -> bytes:
    """`env` as dill bytes for `load_copy`: the environment, then the globals of `__main__` its functions read."""
    import dill  # datasets' own pickler: it ships with every install of ours

    main = sys.modules["__main__"]

    class MainPickler(dill.Pickler):
        """Notes the globals of `__main__` that each copied function of `__main__` reads."""

        def __init__(self, file):
            super().__init__(file)
            self._main = main  # dill's own is `__main__` as it was when dill was imported
            self.read: set[str] = set()

        def save(self, obj, save_persistent_id=True):
            if isinstance(obj, types.FunctionType) and obj.__globals__ is main.__dict__ and id(obj) not in self.memo:
                self.read |= global_names(obj.__code__) & main.__dict__.keys()
            super().save(obj, save_persistent_id)

    buffer = io.BytesIO()
    pickler = MainPickler(buffer)
    pickler.dump(env)
    shipped: set[str] = set()
    while pickler.read - shipped:  # one pickle more per round, sharing the first one's objects (the memo)
        names = sorted(pickler.read - shipped)
        shipped.update(names)
        pickler.dump({name: main.__dict__[name] for name in names})
    return buffer.getvalue()


def load_copy(payload: bytes):
    """The environment of `copy_of`, with the user's globals its functions read put into this process's
    `__main__`."""
    import dill

    stream = io.BytesIO(payload)
    unpickler = dill.Unpickler(stream)
    env = unpickler.load()
    while stream.tell() < len(payload):
        sys.modules["__main__"].__dict__.update(unpickler.load())
    return env


def global_names(code: types.CodeType) -> set[str]:
    """The global names a function's code (nested functions, comprehensions and class bodies included) reads or
    binds."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"}  # LOAD_NAME: a class body's
