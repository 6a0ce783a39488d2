"""Every relative link in the README, docs/ and bench/ resolves: to a file of the repository and,
where it names one, to a heading of that file (GitHub's anchors)."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_files() -> list[Path]:
    return sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "bench").glob("*.md")])


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    out: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out.add(slug)
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_a_broken_link_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title\n[ok](#a-title) [gone](missing.md) [bad](#nowhere) [web](https://x.org)\n")
    assert broken_links(page, root=tmp_path) == ["page.md: missing.md (no such file)", "page.md: #nowhere (no such heading)"]
