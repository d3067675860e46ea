"""Every relative link of README.md and docs/*.md names a file or folder of the repository, and a
``#fragment`` names a heading of the page it points to (GitHub's anchors), so moving a section
to another page cannot leave the README pointing at nothing (issue 36)."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """``text`` without fenced blocks and code spans (a link there is code, not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The fragments GitHub gives ``text``'s headings: lower case, punctuation dropped, spaces
    as hyphens, ``-1``, ``-2`` ... on repeats; plus explicit ``<a id=...>`` anchors."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for title in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out | set(HTML_ANCHOR.findall(text))


def relative_links(page: pathlib.Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


def test_anchors_follow_githubs_rule():
    text = "# kvblend\n## Use it with vLLM\n## CPU (2 vCPUs, no AVX512, float32)\n## `kvblend bench`\n## Faults\n## Faults\n"
    assert anchors(text) == {"kvblend", "use-it-with-vllm", "cpu-2-vcpus-no-avx512-float32",
                             "kvblend-bench", "faults", "faults-1"}


def test_the_readme_links_the_docs_pages():
    links = set(relative_links(ROOT / "README.md"))
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in links, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    bad = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)
