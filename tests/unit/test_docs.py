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

    from verifiers_rl.rl.trainer.config import RLConfig

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
