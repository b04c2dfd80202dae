"""`vf-rl setup [DIR] [--force]`: lay out a verifiers-rl workspace, offline and idempotently, and say what to run
next in it (each step true as printed: tests/e2e/test_cli.py runs them).

`setup_workspace(path, force=False)` is the function other tools (e.g. `prime lab setup --vf-rl`) call."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import NoReturn

FILES = [
    "configs/endpoints.toml",  # what the installed verifiers' vf-eval reads (it refuses endpoints.py)
    "configs/vf-rl/alphabet-sort.toml",
    "configs/vf-rl/gsm8k.toml",
    "configs/vf-rl/math-python.toml",
    "configs/vf-rl/reverse-text.toml",
    "configs/vf-rl/wiki-search.toml",
    "configs/vf-rl/wordle.toml",
    "configs/vf-sft/reverse-text.toml",
    "environments/AGENTS.md",
]


def template(relpath: str) -> str:
    node = resources.files("verifiers_rl.scaffold")
    for part in relpath.split("/"):
        node = node.joinpath(part)
    return node.read_text(encoding="utf-8")


def setup_workspace(path: str | Path = ".", force: bool = False) -> list[tuple[str, str]]:
    """Write the workspace files; returns [(relative path, status)] with status created/unchanged/kept/overwritten."""
    root = Path(path)
    report = []
    for rel in FILES:
        target = root / rel
        text = template(rel)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            status = "created"
        elif target.read_text(encoding="utf-8") == text:
            status = "unchanged"
        elif force:
            target.write_text(text, encoding="utf-8")
            status = "overwritten"
        else:
            status = "kept"  # the user edited it; --force replaces it
        report.append((rel, status))
    return report


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point. It raises SystemExit(code) itself: verifiers' own `vf-*` scripts call `main()`
    and drop its return value, and whichever package was installed last owns the script name."""
    raise SystemExit(run_setup(argv))


def run_setup(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vf-rl setup", description="Lay out a verifiers-rl workspace (offline).")
    p.add_argument("dir", nargs="?", default=".", help="workspace folder (default: current)")
    p.add_argument("--force", action="store_true", help="overwrite files you have edited")
    args = p.parse_args(argv)
    report = setup_workspace(args.dir, force=args.force)
    marks = {
        "created": "✓ created",
        "unchanged": "✓ up to date",
        "overwritten": "✓ overwritten",
        "kept": "• kept (edited; --force to replace)",
    }
    for rel, status in report:
        print(f"{marks[status]:36} {Path(args.dir) / rel}")
    print("\n" + next_steps(args.dir))
    return 0


EXAMPLE = "configs/vf-rl/reverse-text.toml"


def next_steps(workspace: str) -> str:
    """What to run next, from the workspace (vf-eval reads ./configs/endpoints.toml, and the example config's paths
    are its own): its environment, if this machine lacks it; the example's plan and run; a served model evaluated
    through the "local" endpoint."""
    import tomllib

    from verifiers_rl.config.run_file import RunFile
    from verifiers_rl.scripts.environments import environment_status, install_hint

    example = RunFile.parse(tomllib.loads(template(EXAMPLE)))
    env, model = example.env[0].id, example.model
    lines = ["next:"]
    if Path(workspace).resolve() != Path.cwd().resolve():
        lines.append(f"  cd {workspace}")
    if "NOT installed" in environment_status(env):
        lines.append(f"  {install_hint(env).strip('`')}    # the example's environment, {env}")
    lines += [
        f"  vf-rl @ {EXAMPLE} --dry-run    # the plan: GPUs, the server, the trainer, checks",
        f"  vf-rl @ {EXAMPLE}              # train ({model}): the dry run prints where its outputs go",
        f"  vf-vllm --model {model} --served-model-name local --port 8000    # serve a model (--engine cpu: no GPU)",
        f"  vf-eval {env} -m local -n 20    # evaluate it through configs/endpoints.toml's local endpoint",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
