"""Run every benchmark and print one combined table.

    .venv/bin/python benchmarks/run.py [--quick] [--only bench_train,bench_async] [--wait-quiet S]

Imports each benchmark module and calls its `run(quick=..., wait_quiet=...)`; a benchmark that raises is recorded
as a failed row and the others still run. With --only, the other benchmarks' rows are kept from the previous
latest.json of the same mode. Writes benchmarks/results/latest.json and latest.md (the table, the
machine, the command to reproduce); --quick writes latest_quick.{json,md}. Exit code: 0 when every benchmark ran,
whether or not its goals were met; 1 when one crashed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS_DIR, _fmt, machine, wait_for_quiet  # noqa: E402

BENCHMARKS = (
    "bench_engine",
    "bench_client",
    "bench_server_http",
    "bench_server_start",
    "bench_sync",
    "bench_sync_delta",
    "bench_sharded",
    "bench_train",
    "bench_async",
    "bench_e2e",
    "bench_scaling",
    "bench_endurance",
    "bench_load",
    "bench_roofline",
    "bench_reward_time",
    "bench_overhead",
    "bench_cpu_tunings",
)
HEADERS = ["benchmark", "metric", "unit", "baseline", "ours", "ratio", "goal", "pass"]


def _cells(bench: str, r: dict) -> list[str]:
    ratio = r.get("ratio")
    return [
        bench,
        str(r.get("name", "")),
        r.get("unit", "") or "",
        _fmt(r.get("baseline")),
        _fmt(r.get("ours")),
        (_fmt(ratio) + "x") if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) else _fmt(ratio),
        r.get("goal") or "-",
        {True: "PASS", False: "FAIL", None: "-"}.get(r.get("pass"), str(r.get("pass"))),
    ]


def text_table(lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(HEADERS)]
    head = "  ".join(h.ljust(w) for h, w in zip(HEADERS, widths))
    out = [head, "-" * len(head)]
    for c in lines:
        out.append("  ".join(x.ljust(w) if i < 3 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))))
    return "\n".join(out)


def md_table(lines: list[list[str]]) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    out += ["| " + " | ".join(esc(x) for x in c) + " |" for c in lines]
    return "\n".join(out)


def run_one(name: str, quick: bool, wait_quiet: float | None) -> dict:
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(name)
        res = mod.run(quick=quick, wait_quiet=wait_quiet)
        return {
            "name": name,
            "ok": True,
            "seconds": time.perf_counter() - t0,
            "rows": res.get("rows", []),
            "passed": res.get("passed"),
            "machine_before": res.get("machine_before"),
        }
    except BaseException as e:  # noqa: BLE001 - record and keep going (KeyboardInterrupt still stops the run)
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        return {
            "name": name,
            "ok": False,
            "seconds": time.perf_counter() - t0,
            "error": f"{type(e).__name__}: {e}",
            "traceback": tb[-4000:],
            "rows": [],
            "passed": False,
        }


def _merge_previous(results: list[dict], quick: bool) -> list[dict]:
    """--only re-runs some benchmarks: keep the others' rows from the last latest.json of the same mode (each
    entry carries its own measured_at), so the table stays complete."""
    path = RESULTS_DIR / ("latest_quick.json" if quick else "latest.json")
    try:
        prev = json.loads(path.read_text())
    except (OSError, ValueError):
        return results
    if prev.get("quick") != quick:
        return results
    by_name = {r["name"]: r for r in prev.get("benchmarks", [])}
    by_name.update({r["name"]: r for r in results})
    return [by_name[n] for n in BENCHMARKS if n in by_name]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every benchmark's quick mode (CI smoke test, < 6 min)")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(BENCHMARKS))
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        metavar="S",
        help="passed to every benchmark: wait up to S s for an idle machine (default: theirs)",
    )
    args = p.parse_args(argv)
    names = BENCHMARKS if not args.only else tuple(n.strip() for n in args.only.split(",") if n.strip())
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}")

    t_start = time.perf_counter()
    quiet = wait_for_quiet(0)  # one reading of the machine's load, for the record
    results = []
    for name in names:
        print(f"\n######## {name} ({'quick' if args.quick else 'full'})", flush=True)
        r = run_one(name, args.quick, args.wait_quiet)
        print(f"######## {name}: {'ran' if r['ok'] else 'CRASHED'} in {r['seconds']:.1f}s", flush=True)
        r["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        results.append(r)
    wall = time.perf_counter() - t_start
    if args.only:
        results = _merge_previous(results, args.quick)

    lines = []
    for r in results:
        if not r["ok"]:
            lines.append([r["name"], f"CRASHED: {r['error'][:120]}", "", "-", "-", "-", "-", "FAIL"])
        for row in r["rows"]:
            lines.append(_cells(r["name"], row))
    title = f"benchmarks ({'quick' if args.quick else 'full'}), {wall:.0f}s"
    table = text_table(lines)
    print(f"\n== {title} ==\n{table}", flush=True)
    for r in results:
        print(f"  {r['name']}: {r['seconds']:.1f}s, machine before: {r.get('machine_before')}")

    cmd = ".venv/bin/python benchmarks/run.py" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])).rstrip()
    info = machine()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {
        "quick": args.quick,
        "wall_seconds": wall,
        "command": cmd,
        "machine": info,
        "machine_at_start": quiet,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "benchmarks": results,
    }
    stem = "latest_quick" if args.quick else "latest"  # a smoke test never overwrites the full run's numbers
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md = [
        f"# Benchmarks ({'quick' if args.quick else 'full'})",
        "",
        md_table(lines),
        "",
        "Per benchmark (wall seconds; machine load seen before timing, from `_common.wait_for_quiet`):",
        "",
    ]
    for r in results:
        status = "ran" if r["ok"] else f"crashed: `{r['error'][:200]}`"
        md.append(
            f"- `{r['name']}`: {status}, {r['seconds']:.1f}s, measured {r.get('measured_at', '?')}, machine "
            f"before: {r.get('machine_before')}"
        )
    md += [
        "",
        "Machine:",
        "",
        "```",
        json.dumps(info, indent=2),
        "```",
        "",
        f"Reproduce (from the repository root): `{cmd}`",
        f"Written {payload['written_at']}, total {wall:.0f}s.",
        "",
    ]
    (RESULTS_DIR / f"{stem}.md").write_text("\n".join(md))
    print(f"results: {RESULTS_DIR / (stem + '.json')}, {RESULTS_DIR / (stem + '.md')}")

    crashed = [r["name"] for r in results if not r["ok"]]
    if crashed:
        print(f"crashed: {', '.join(crashed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
