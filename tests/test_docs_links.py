"""The README and docs/ pages hold together: every relative link and anchor resolves, every cited
bench/results file exists, Python snippets parse, and the README stays a short user guide that starts
with the two commands CI and users run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 350  # the house's limit (issue 50): a guide one reads top to bottom; detail and evidence go to docs/
TWO_COMMANDS = [
    "make demo   # creates .venv, trains a small char-level GPT with fp32 and 8-bit states (paired, 3 seeds): "
    "memory, loss gap",
    "make test   # creates .venv, runs ruff and the test suite (CPU only)",
]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_RESULT = re.compile(r"`(bench/results/[^`]*)`")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (a link-like string in code is not a link)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _prose(page.read_text()), re.M)}


def links(page: Path) -> list[str]:
    """The relative link targets of a page (web and mail links left out)."""
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def broken_links(page: Path) -> list[str]:
    """Targets whose file, or whose #anchor in that file, does not exist."""
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_cited_results_files_exist(page: Path) -> None:
    """A `bench/results/...` path named in prose exists (bench/results keeps one current result per
    benchmark; a page citing a deleted run is stale). Patterns with <...> or * are not paths."""
    cited = [p for p in _RESULT.findall(_prose(page.read_text())) if not re.search(r"[<*{]|\.\.\.", p)]
    assert [p for p in cited if not (ROOT / p).exists()] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_snippets_parse(page: Path) -> None:
    for lang, code in _FENCE.findall(page.read_text()):
        if lang == "python":
            ast.parse(code)


def test_readme_is_a_short_guide_that_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    first_lang, first_code = _FENCE.findall(text)[0]
    assert (first_lang, first_code.splitlines()) == ("bash", TWO_COMMANDS)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_the_checks_catch_a_broken_link_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: with punctuation\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading-with-punctuation) [gone](missing.md) [bad](there.md#nope)\n"
                    "[web](https://example.com)\n```\n[in code](missing.md)\n```\n")
    assert broken_links(page) == ["missing.md", "there.md#nope"]


@pytest.mark.parametrize("package", ["transformers", "lightning", "accelerate"])
def test_the_readme_names_the_framework_versions_the_tests_ran_with(package: str) -> None:
    """The README's tested-versions table is what this environment installed (the test extra)."""
    from importlib.metadata import version

    rows = dict(re.findall(r"^\| (\w+) \| ([\d.]+)\b", (ROOT / "README.md").read_text(), flags=re.M))
    assert rows.get(package) == version(package), f"README's table: update {package}'s row to {version(package)}"
