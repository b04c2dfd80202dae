"""Shared helpers for the benchmarks: timing statistics, the result table, and the JSON result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def git_commit() -> str:
    """The commit a result was measured at (provenance for benchmarks/results/), "unknown" outside a checkout."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "loadavg_1_5_15": list(os.getloadavg()),
    }


def cpu_busy(window_s: float = 1.0) -> float:
    """Fraction of all CPUs busy (system-wide, from /proc/stat) over `window_s`; nan where unavailable."""

    def snap():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    try:
        t0, i0 = snap()
        time.sleep(window_s)
        t1, i1 = snap()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_for_quiet(max_wait_s: float, threshold: float = 0.15, log=print) -> dict:
    """Timings on a 2-core machine are only meaningful when nothing else runs. Wait (at most `max_wait_s`) until
    the machine has been under `threshold` busy for two 1-second windows in a row; report what was seen."""
    t0 = time.monotonic()
    quiet, last = 0, float("nan")
    while True:
        last = cpu_busy(1.0)
        quiet = quiet + 1 if last < threshold else 0
        if quiet >= 2 or time.monotonic() - t0 >= max_wait_s:
            break
    waited = time.monotonic() - t0
    ok = quiet >= 2
    if not ok and max_wait_s > 0:
        log(f"warning: machine still {last:.0%} busy after {waited:.0f}s; timings may be inflated by other work")
    return {"quiet": ok, "waited_s": round(waited, 1), "busy_fraction": round(last, 3)}


def left_padded_prompts(tok, rows: list[dict]):
    """The rows' chat prompts (generation prompt added) as one left-padded batch for HF `generate`:
    (input_ids, attention_mask, width); completions start at column `width`."""
    import torch

    prompts = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"] for r in rows
    ]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    att = torch.zeros(len(prompts), width, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p) :], att[j, width - len(p) :] = torch.tensor(p), 1
    return ids, att, width


def cpu_server(model: str, work: str, **serve_kwargs):
    """An `InferenceServer` (the trainer's launcher: free port, a health wait that fails fast with the log's tail,
    the process group stopped on exit) whose process runs `cpu.app.serve(model, **serve_kwargs)`: for benchmarks
    that compare server options the command line does not offer (the chat route, uvicorn's parser, model loading)."""
    from verifiers_rl.serving.launcher import InferenceServer

    class Variant(InferenceServer):
        def command(self) -> list[str]:
            options = "".join(f", {k}={v!r}" for k, v in serve_kwargs.items())
            code = (
                "from verifiers_rl.inference.cpu.app import serve; "
                f"serve({model!r}, port={self.port}, log_level='warning', access_log=False{options})"
            )
            return [self.python, "-c", code]

    return Variant(model, engine="cpu", output_dir=work, startup_timeout=120.0)


def sync_server(model_dir, out: str, startup_timeout: float = 300):
    """Our CPU engine as the sync benchmarks run it (the trainer's launcher, engine="cpu"): a small KV cache and a
    quiet log, so the server's own work stays out of what a sync costs."""
    from verifiers_rl.serving.launcher import InferenceServer

    args = ["--max-model-len", "1024", "--max-num-seqs", "8", "--log-level", "warning"]
    return InferenceServer(
        str(model_dir), engine="cpu", output_dir=out, extra_args=args, startup_timeout=startup_timeout
    )


def row(name: str, baseline, ours, ratio, goal: str, passed: bool | None, unit: str = "", **extra) -> dict:
    """One line of a result table. `passed` is None for rows that only report (no goal)."""
    return {
        "name": name,
        "baseline": baseline,
        "ours": ours,
        "ratio": ratio,
        "goal": goal,
        "pass": passed,
        "unit": unit,
        **extra,
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # nan
            return "nan"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.4f}"
    return str(v)


def print_table(title: str, rows: list[dict], file=sys.stdout) -> None:
    headers = ["metric", "unit", "baseline", "ours", "ratio", "goal", "pass"]
    cells = [
        [
            r["name"],
            r.get("unit", ""),
            _fmt(r["baseline"]),
            _fmt(r["ours"]),
            (_fmt(r["ratio"]) + "x") if isinstance(r["ratio"], (int, float)) else _fmt(r["ratio"]),
            r["goal"] or "-",
            {True: "PASS", False: "FAIL", None: "-"}[r["pass"]],
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(f"\n== {title} ==", file=file)
    print(line, file=file)
    print("-" * len(line), file=file)
    for c in cells:
        print("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))), file=file)
    file.flush()


def write_results(name: str, result: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    result = {**result, "machine": machine(), "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def all_passed(rows: list[dict]) -> bool:
    return all(r["pass"] is not False for r in rows)


def finish(
    name: str,
    quick: bool,
    results: dict,
    t_start: float,
    tables: list[tuple[str, list[dict]]],
    notes: tuple[str, ...] = (),
) -> dict:
    """Every benchmark's ending: goal rows into `results`, the tables printed, results/<name>[_quick].json."""
    results["rows"] = tables[0][1]
    results["passed"] = all_passed(tables[0][1])
    results["wall_seconds"] = time.perf_counter() - t_start
    for title, rows in tables:
        print_table(title, rows)
    for note in notes:
        print(note)
    print(f"total {results['wall_seconds']:.1f}s; machine before: {results.get('machine_before')}")
    print(f"results: {write_results(name + ('_quick' if quick else ''), results)}")
    return results


def arg_parser(doc: str, quick_help: str):
    """The options every benchmark takes: --quick and --wait-quiet."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        metavar="S",
        help="wait up to S seconds for an idle machine before timing (default: 180, 0 with --quick)",
    )
    return p


def main_for(run, doc: str, quick_help: str, argv=None) -> int:
    """`main()` of a benchmark whose only options are --quick and --wait-quiet: exit 0 when its goals pass."""
    args = arg_parser(doc, quick_help).parse_args(argv)
    return 0 if run(quick=args.quick, wait_quiet=args.wait_quiet)["passed"] else 1
