"""The documents: docs/cli.md is what the parser gives now, and every relative link in the
README, BENCHMARKS.md and docs/ reaches a file (and, with a #fragment, a heading) that exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "tools" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_generated_from_the_parser():
    gen = _generator()
    assert (ROOT / "docs" / "cli.md").read_text() == gen.render(), (
        "docs/cli.md differs from the parser: run `make docs` (python tools/gen_cli_docs.py)"
    )


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        base = _slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_relative_links_reach_files_and_headings():
    broken = []
    for page in PAGES:
        for line in _prose(page.read_text()):
            for target in _LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, fragment = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220
