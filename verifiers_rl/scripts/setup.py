"""`vf-rl setup [DIR] [--force]`: lay out a verifiers-rl workspace, offline and idempotently.

`setup_workspace(path, force=False)` is the function other tools (e.g. `prime lab setup --vf-rl`) call."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import NoReturn

FILES = [
    "configs/endpoints.py",
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
    print(
        f"\nnext: pip install -e environments/<name>, then vf-rl @ {Path(args.dir) / 'configs/vf-rl/reverse-text.toml'}"
    )
    return 0


if __name__ == "__main__":
    main()
