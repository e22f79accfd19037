"""The README, docs/ and the results READMEs link to files and headings that exist: a page split or renamed
leaves no dead link.

Every markdown link in README.md, docs/*.md and bench/results/*/README.md that is not a URL must name a file
or folder of the repository, and where it names a heading (`page.md#anchor`, or `#anchor` on the same page),
that heading, with its anchor made as GitHub makes it.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "bench" / "results").glob("*/README.md"))]

LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
CODE_SPAN = re.compile(r"`[^`]*`")


def prose_lines(text: str):
    """The lines outside fenced code blocks, with inline code spans blanked (a `[x](y)` in code is no link)."""
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield CODE_SPAN.sub("``", line)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file: lowercased, punctuation but - and _
    dropped, spaces made hyphens, and a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    result = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def dead_links(page: Path) -> list[str]:
    dead = []
    for line in prose_lines(page.read_text()):
        for match in LINK.finditer(line):
            target = match.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                dead.append(f"{target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                dead.append(f"{target} (no heading with that anchor in {linked.name})")
    return dead


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_local_link_resolves(page):
    assert dead_links(page) == []


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Launching: threads, torchrun\n\n## Failure\n\n## Failure\n")
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](other.md#launching-threads-torchrun) [ok](other.md#failure-1) [ok](#top)\n"
                    "[gone](missing.md) [bad](other.md#stopping) [bad](#nowhere) [web](https://example.org/x)\n"
                    "`[code](not-a-link.md)`\n```\n[fenced](not-a-link-either.md)\n```\n")
    assert dead_links(page) == ["missing.md (no such file)", "other.md#stopping (no heading with that anchor in "
                                "other.md)", "#nowhere (no heading with that anchor in page.md)"]


def test_the_readme_stays_short_and_keeps_its_two_commands():
    """The README is read in minutes (details live in docs/), and CI (.ci/run) runs its second command as it is."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert ci in readme.splitlines()
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m xtrain_dist.train_ddp " \
           "300 16 64 --world-size 2 --report runs/tiny.json" in readme.splitlines()
