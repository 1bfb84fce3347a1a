"""The README and docs/ agree with the tree: every relative link reaches a file, and
every `#anchor` a heading of that file (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += [ROOT / "deploy" / "kubernetes" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        unknown = file.exists() and file.suffix == ".md" and anchor and anchor not in anchors(file)
        if not file.exists() or unknown:
            broken.append(target)
    assert broken == []


def test_the_front_page_reads_in_ten_minutes():
    """What it is, the two commands, the picture, the architecture, then one table."""
    readme = (ROOT / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert sections[:2] == ["Architecture", "Measured against stock vLLM"]
    assert readme.index("make demo") < readme.index("![") < readme.index("## Architecture")
    assert len(readme.split()) < 2_500  # ten minutes at 250 words a minute
    measured = readme.split("## Measured against stock vLLM")[1].split("\n## ")[0]
    assert measured.count("\n| ---") == 1  # one headline table


def test_the_layout_names_every_module():
    layout = (ROOT / "README.md").read_text().split("## Layout")[1].split("```")[1]
    named = set(re.findall(r"[\w]+\.py", layout))
    packages = ("engine", "exporters", "server", "demo", "replay", "dashboard")
    modules = {p.name for pkg in packages for p in (ROOT / pkg).glob("*.py")}
    assert modules - {"__init__.py"} <= named
