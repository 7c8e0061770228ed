"""The documentation: its code samples run, its links land, and the README points into it.

`mkdocs build --strict` (run by `make lint`) checks links between pages and their anchors, and
the API reference; it does not see the README (not part of the site) nor run any code. These
tests do both, without mkdocs, in the unit lane.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))

_PYTHON_BLOCK = re.compile(
    r'^```python(?:[ \t]+title="(?P<title>[^"]*)")?[ \t]*\n(?P<body>.*?)^```[ \t]*$',
    re.MULTILINE | re.DOTALL,
)
# [text](target): a target with no scheme is a page of ours, or an anchor on this page.
_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    title: str | None
    body: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [
        Block(page, text.count("\n", 0, m.start()) + 1, m["title"], m["body"])
        for m in _PYTHON_BLOCK.finditer(text)
    ]


BLOCKS = [block for page in PAGES for block in python_blocks(page)]
RUNNABLE = [b for b in BLOCKS if b.title is None]
# The README's samples talk to a broker: GitHub and PyPI show no block titles, so none is
# marked; each is checked as a sample that needs one.
NEEDS_MORE = [b for b in BLOCKS if b.title is not None] + [
    Block(b.page, b.line, b.title or "needs a broker", b.body) for b in python_blocks(README)
]


def slug(heading: str) -> str:
    """The anchor Python-Markdown's `toc` gives a heading (its default `slugify`)."""
    text = re.sub(r"[`*]", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*$", text, re.MULTILINE)}


def broken_links(page: Path) -> list[str]:
    """Every link of `page` to a page of ours or an anchor that does not exist."""
    text = _INLINE_CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    broken = []
    for m in _LINK.finditer(text):
        target = m["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.is_file():
            broken.append(f"{target}: no file {linked.relative_to(ROOT)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    return broken


def test_the_site_has_the_pages_each_reader_starts_from():
    assert {p.relative_to(DOCS).as_posix() for p in PAGES} >= {
        "index.md",
        "getting-started.md",
        "trainer/client.md",
        "trainer/sessions.md",
        "trainer/replay.md",
        "trainer/wire-format.md",
        "operator/settings.md",
        "operator/security.md",
        "operator/control-plane.md",
        "operator/fleet.md",
        "operator/sizing.md",
        "operator/observability.md",
        "design/delivery.md",
        "design/rebalances.md",
        "design/breaker.md",
        "design/simulation.md",
        "reference/schemas.md",
        "reference/client.md",
    }


def test_the_docs_hold_runnable_samples_and_broker_samples():
    # A regex that stopped matching would pass every test below on no block at all.
    assert len(RUNNABLE) >= 3
    assert len(NEEDS_MORE) >= 3


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_a_runnable_python_sample_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(block.body, str(block), "exec")
    exec(code, {"__name__": "__docs__"})  # noqa: S102 - our own documentation's samples


@pytest.mark.parametrize("block", NEEDS_MORE, ids=str)
def test_a_sample_that_needs_a_broker_compiles_and_its_imports_run(block):
    assert block.title is not None and block.title.startswith("needs "), (
        f'{block}: a python block is runnable, or titled "needs ..." (got {block.title!r})'
    )
    # Samples show `async with` at top level, as in a notebook or an asyncio REPL.
    tree = compile(
        block.body, str(block), "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    )
    imports: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert imports, f"{block}: a sample that cannot run should at least show its imports"
    module = ast.Module(body=imports, type_ignores=[])
    exec(compile(module, str(block), "exec"), {})  # noqa: S102


@pytest.mark.parametrize("page", [*PAGES, README], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_names_a_page_and_heading_that_exist(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# A page\n\n## Its part\n")
    page = tmp_path / "b.md"
    page.write_text(
        textwrap.dedent("""\
        # B

        [fine](a.md#its-part) [here](#b) [gone](c.md) [no anchor](a.md#elsewhere)
        `[in code](d.md)` [outside](https://example.org/x)
        """)
    )

    assert broken_links(page) == [
        "c.md: no file c.md",
        "a.md#elsewhere: no heading #elsewhere in a.md",
    ]


def test_slug_matches_the_anchors_the_site_builds():
    # Python-Markdown's toc `slugify`: lowercase, punctuation dropped, spaces to hyphens.
    assert slug("Results larger than a record: parts and payload references") == (
        "results-larger-than-a-record-parts-and-payload-references"
    )
    assert slug("Checking a run's routing") == "checking-a-runs-routing"
    assert slug("`make demo` and `RolloutClient`") == "make-demo-and-rolloutclient"


def test_the_readme_is_short_and_links_every_reader_into_the_site():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    linked = {m["target"].partition("#")[0] for m in _LINK.finditer(text)}
    assert {
        "docs/getting-started.md",
        "docs/trainer/client.md",
        "docs/operator/settings.md",
        "docs/design/delivery.md",
    } <= linked
    # The two commands, as the first code a reader sees.
    first_block = re.search(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert first_block is not None
    assert [line.split("#")[0].strip() for line in first_block[1].splitlines()] == [
        "make demo",
        "make test",
    ]
