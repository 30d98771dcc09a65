"""The front door stays true: README within 200 lines, and every relative link in README.md, BENCHMARKS.md
and docs/*.md points at a file that exists (and at a heading that exists, for #anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    headings = [ln for ln in lines if ln.startswith("## ")]
    for must in ("## Install", "## Quick start", "## Results"):
        assert must in headings


def test_readmes_results_say_which_rows_are_gpu_rows():
    """Issue 62: "no GPU number has been measured yet" stood above a table with an H100 row. Whatever the intro
    says about GPUs must agree with the table: a GPU row is a row the intro allows."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    results = text[text.index("## Results"):text.index("## Tests")]
    intro, table = results.split("\n|", 1)
    gpu_rows = [row for row in table.splitlines() if re.search(r"\b(H100|H200|A100|GPU)\b", row)]
    assert "no GPU number has been measured" not in intro
    if gpu_rows:
        assert "unless the row names a GPU" in intro and "BENCHMARKS.md#gpu" in intro


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == []


def test_every_config_key_is_documented():
    """docs/configuration.md names every key of every section (a new key without a line there fails)."""
    import dataclasses
    import typing

    from aiayn.config import Config

    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    starts = {m.group(1): m.start() for m in re.finditer(r"^## (\w+):", text, flags=re.M)}
    missing = []
    for name, section in typing.get_type_hints(Config).items():
        if not dataclasses.is_dataclass(section):
            continue
        end = min([v for v in starts.values() if v > starts[name]] + [len(text)])
        body = text[starts[name]:end]
        missing += [f"{name}.{f.name}" for f in dataclasses.fields(section) if f"`{f.name}`" not in body]
    assert missing == []


def test_every_limit_is_documented():
    from aiayn.config import LIMITS

    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = text[text.index("## Limits"):]
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| ([^|]+) \|$", section, flags=re.M))
    want = {k: (f"{v:,}" if isinstance(v, int) else f"{v:g}") for k, v in LIMITS.items()}
    assert rows == want


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_name_no_path_of_the_machine_they_were_written_on(page):
    # a path under a user's or a build machine's home tells a reader nothing and leaks where it was made
    found = re.findall(r"(?<![\w.~])/(?:work|home|Users|root)/[^\s`)\"']*", page.read_text(encoding="utf-8"))
    assert found == []


def test_every_row_of_the_cost_of_a_change_names_a_test_that_exists():
    """docs/architecture.md's "Cost of a change": each row is measured by a test, named `tests/FILE.py` or
    `tests/FILE.py::NAME`; each named file and test is there."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("## Cost of a change", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| a new")]
    assert len(rows) >= 5
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", row.rsplit(" | ", 1)[1])
        assert named, row[:60]
        for path, name in named:
            source = (REPO / path).read_text(encoding="utf-8")
            assert not name or f"def {name}(" in source, f"{path}::{name}"
