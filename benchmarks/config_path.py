"""The path the configuration takes through the code: `vf-rl @ CONFIG --dry-run` traced from its entry to the
printed plan, every call of a function of ours that is handed the configuration recorded by module.

What counts as the configuration: a `RunFile`, one of its sections (or a list of them: the [[env]] tables), the TOML
as data (the dicts `config.toml` returns, and every table in them), a run file's `[trainer.args]`, and what a
function handed any of these returns (a run file's own method reading it is not a stop; what it returns counts).
A *stop* is a run of such calls in one module (consecutive calls in the same module are one stop); a *climb* is a
stop in a module the configuration had already left. `python benchmarks/config_path.py [CONFIG]` prints the path
and the counts; tests/unit/test_config.py holds them to the issue's bounds (20 stops, 4 climbs).
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEBUG = False
DEFAULT = ROOT / "configs" / "vf-rl" / "tiny-reverse-text.toml"


def trace(config: str | Path = DEFAULT) -> list[tuple[str, str]]:
    """[(module, function)] of every call of ours handed the configuration, in call order."""
    from verifiers_rl.config.run_file import RunFile, Section
    from verifiers_rl.scripts.rl import run_command

    calls: list[tuple[str, str]] = []
    data: set[int] = set()  # the TOML as dicts: what toml.load returned, and every table in it
    alive: list = []  # kept, so that no other object gets the id of one of them
    read: list[RunFile] = []
    handed_to: set = set()  # frames of the calls recorded

    def tables(value) -> None:
        if isinstance(value, dict):
            data.add(id(value))
            alive.append(value)
            for v in value.values():
                tables(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                tables(v)

    def carries(value) -> bool:
        if isinstance(value, RunFile):
            if not any(value is r for r in read):
                read.append(value)
                tables(value.trainer.args)
            return True
        if isinstance(value, Section):
            return True
        if isinstance(value, list) and value and all(isinstance(v, Section) for v in value):
            return True
        return isinstance(value, dict) and id(value) in data

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("verifiers_rl") or frame.f_code.co_name.startswith("<"):
            return
        if event == "return" and (module == "verifiers_rl.config.toml" or frame in handed_to):
            # the file as loaded, with the overrides, in our spelling; what a function handed it makes of it
            tables(arg[0] if isinstance(arg, tuple) else arg)
        if event != "call":
            return
        if isinstance(frame.f_locals.get("self"), RunFile):
            carries(frame.f_locals["self"])  # a run file being read: its [trainer.args] is the configuration too
            handed_to.add(frame)  # and what its methods return (env_spec, rl_arguments) is the configuration
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        # a method of the run file reading itself is the configuration being read, not going somewhere
        handed = [n for n in names if n not in ("self", "cls")]
        if any(carries(frame.f_locals.get(n)) for n in handed):
            calls.append((module, code.co_name))
            handed_to.add(frame)
            if DEBUG:
                print(module, code.co_name, [n for n in handed if carries(frame.f_locals.get(n))], file=sys.stderr)

    out = io.StringIO()
    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(out):
            code = run_command(["@", str(config), "--dry-run"])
    finally:
        sys.setprofile(None)
    if code != 0:
        raise RuntimeError(f"vf-rl --dry-run exited {code}")
    return calls


def stops(calls: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Consecutive calls in one module collapsed: [(module, [functions])]."""
    out: list[tuple[str, list[str]]] = []
    for module, function in calls:
        if out and out[-1][0] == module:
            out[-1][1].append(function)
        else:
            out.append((module, [function]))
    return out


def climbs(path: list[tuple[str, list[str]]]) -> list[int]:
    """Indexes of the stops in a module the configuration had left before."""
    return [i for i, (module, _) in enumerate(path) if any(m == module for m, _ in path[: max(i - 1, 0)])]


def main() -> int:
    path = stops(trace(sys.argv[1] if len(sys.argv) > 1 else DEFAULT))
    back = set(climbs(path))
    for i, (module, functions) in enumerate(path):
        mark = "  <- climbs back" if i in back else ""
        print(f"{i + 1:2d}. {module}: {', '.join(dict.fromkeys(functions))}{mark}")
    print(f"{len(path)} stops in {len({m for m, _ in path})} modules, {len(back)} climbs back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
