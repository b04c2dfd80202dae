"""Docs match the code: the generated configuration reference is current, quoted errors still exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    from verifiers_rl.scripts.config_docs import render

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "docs/configuration.md is stale: run python -m verifiers_rl.scripts.config_docs"


def test_configuration_reference_lists_every_rlconfig_field():
    import dataclasses

    from transformers import TrainingArguments

    from verifiers_rl.config.rl_config import RLConfig

    doc = (ROOT / "docs" / "configuration.md").read_text()
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    for f in dataclasses.fields(RLConfig):
        if f.name not in base:
            assert f"| `{f.name}` |" in doc, f.name


def test_troubleshooting_quotes_real_messages():
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    quotes = re.findall(r"^> `(.+)`$", doc, re.M)
    assert len(quotes) >= 10
    source = "\n".join(p.read_text() for p in (ROOT / "verifiers_rl").rglob("*.py"))
    for q in quotes:
        assert q in source, f"troubleshooting quotes a message the code no longer has: {q!r}"


def test_doc_links_resolve():
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_performance_table_is_the_committed_full_run():
    """The headline multiple of every row in docs/performance.md's current table is a row of
    benchmarks/results/latest.json (the full run the table names) at the precision printed, and a row's ✓ / ✗ is
    that benchmark row's pass / fail."""
    import json

    doc = (ROOT / "docs" / "performance.md").read_text()
    section = doc.split("## Current results", 1)[1].split("\n## ", 1)[0]
    latest = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    assert not latest["quick"]
    assert "benchmarks/results/latest.json" in section, "the current table no longer names the run it shows"
    rows = [r for b in latest["benchmarks"] for r in b["rows"]]

    def values(r):  # the ratio as reported, and both ways of dividing the two measurements
        out = [r["ratio"]] if isinstance(r.get("ratio"), (int, float)) else []
        if isinstance(r.get("baseline"), (int, float)) and isinstance(r.get("ours"), (int, float)) and r["ours"]:
            out += [r["baseline"] / r["ours"], r["ours"] / r["baseline"]]
        return out

    table = [line for line in section.splitlines() if line.startswith("| ") and "×" in line]
    assert len(table) >= 8
    for line in table:
        ours = line.split("|")[3]
        for number in re.findall(r"(\d+(?:\.\d+)?)×", ours)[:1]:  # the headline (a ceiling may follow it)
            places = len(number.split(".")[1]) if "." in number else 0
            matches = [r for r in rows if any(round(v, places) == float(number) for v in values(r))]
            assert matches, f"performance.md's {number}× is not in benchmarks/results/latest.json: {line}"
            verdict = "✓" if "✓" in line else "✗" if "✗" in line else None
            if verdict:
                judged = [r["pass"] for r in matches if r.get("pass") is not None]
                assert judged and (verdict == "✓") in judged, f"{verdict} disagrees with the run: {line}"


def test_protocol_states_the_code_s_default_bucket_size():
    import dataclasses

    from verifiers_rl.config.rl_config import RLConfig
    from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES

    doc = (ROOT / "docs" / "protocol.md").read_text()
    stated = re.findall(r"buckets \(default (\d+) MiB", doc)
    assert stated, "docs/protocol.md no longer states the default bucket size"
    trainer_default = next(f.default for f in dataclasses.fields(RLConfig) if f.name == "sync_bucket_mb")
    assert {int(s) << 20 for s in stated} == {DEFAULT_BUCKET_BYTES, trainer_default << 20}


def test_readme_use_your_model_step_serves_and_evaluates_the_main_jobs_model():
    """The step after the main job serves that job's final/ and runs vf-eval on its environment, with its env args,
    temperature and token limit; `vf-rl export`'s usage in the README is the command's own."""
    import json
    import shlex
    import tomllib

    from verifiers_rl.scripts.export import USAGE

    readme = (ROOT / "README.md").read_text()
    before, after = readme.split("### Use your model", 1)
    assert "vf-rl @ configs/vf-rl/tiny-reverse-text.toml" in before.split("## Set up and test", 1)[1]
    section = after.split("\n## ", 1)[0]
    cfg = tomllib.loads((ROOT / "configs" / "vf-rl" / "tiny-reverse-text.toml").read_text())
    args = cfg["trainer"]["args"]
    final = f"outputs/{args['run_name']}/final"  # vf-rl's output_dir: outputs/<run_name>
    serve, evaluate = (shlex.split(c) for c in re.findall(r"```bash\n(.+?)\n```", section))
    assert serve[:3] == [".venv/bin/vf-vllm", "--model", final] and "--port" in serve
    port = serve[serve.index("--port") + 1]
    assert evaluate[:2] == [".venv/bin/vf-eval", cfg["env"]["id"]]
    flag = {k: v for k, v in zip(evaluate[2::2], evaluate[3::2])}
    assert flag["-m"] == final and flag["-b"] == f"http://127.0.0.1:{port}/v1"
    assert json.loads(flag["-a"]) == cfg["env"]["args"]
    assert float(flag["-T"]) == args["temperature"] and int(flag["-t"]) == args["max_tokens"]
    assert int(flag["-n"]) == cfg["eval"]["num_examples"]
    table = readme.split("## Commands", 1)[1]
    assert f"| `{USAGE.removeprefix('usage: ').replace('|', chr(92) + '|')}` |" in table


# Files named in prose that are not this repository's: another project's modules, files a test or a user writes.
NOT_OURS = {
    "model_loader/checkpoint_weight_patch.py": "vLLM's",
    "v1/engine/core_client.py": "vLLM's",
    "script.py": "a user's training script",
    "train_reverse_text.py": "a user's training script, written by the test",
    "broken_env.py": "written by the test",
    "stuck_env.py": "written by the test",
    "sitecustomize.py": "Python's startup hook, written by the test",
    "vf_carried_dep.py": "written by the test",
    "endpoints.py": "the file vf-eval refuses (setup.py writes endpoints.toml)",
    "configs/endpoints.py": "the file vf-eval refuses (setup.py writes endpoints.toml)",
    "gpu_trainer_cpu_engine.py": "the script of a recorded GPU run, since replaced by gpu_check.py",
    "benchmarks/gpu_trainer_cpu_engine.py": "the script of a recorded GPU run, since replaced by gpu_check.py",
    "gpu_smoke.py": "a script of a recorded GPU run, since removed",
}
# Records of the past name the modules of their day; everything else names the code as it is.
RECORDS = {"CHANGELOG.md", "benchmarks/results/history.md"}
MODULE = re.compile(r"(?<![\w./-])((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*\.py)\b")


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a file's prose: a Markdown file whole, a Python file's comments and docstrings."""
    import ast
    import io
    import tokenize

    text = path.read_text()
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    out = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]
    out = [(line, s) for line, s in out if s.startswith("#")]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.append((first.lineno, first.value.value))
    return out


def test_prose_names_only_modules_that_exist():
    """Comments, docstrings and docs that name a module (a file name ending in .py, bare or under its folders)
    name one this repository has: a reorganisation that moves or merges a module updates what points at it."""
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    files = [f for f in listed.stdout.split() if (ROOT / f).is_file()]
    ours = [f for f in files if f.endswith(".py")]
    names = {Path(f).name for f in ours}

    def exists(name: str) -> bool:
        return name in names if "/" not in name else any(f == name or f.endswith("/" + name) for f in ours)

    stale = []
    for f in files:
        if (
            f in RECORDS
            or not f.endswith((".py", ".md"))
            or not f.startswith(("verifiers_rl/", "docs/", "benchmarks/", "tests/", "README"))
        ):
            continue
        for line, text in _prose(ROOT / f):
            stale += [f"{f}:{line}: {m}" for m in MODULE.findall(text) if m not in NOT_OURS and not exists(m)]
    assert not stale, "prose names modules that do not exist:\n" + "\n".join(stale)
