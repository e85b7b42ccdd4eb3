"""The documentation pages and their parts (prose, fenced code blocks), shared by the tests that read them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a link inside a code block is text, not a link)."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def code_blocks(page: Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """The page's fenced code blocks: (language after the fence, '' if none; [(line number, line), ...])."""
    blocks, block = [], None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if FENCE.match(line.strip()):
            if block is None:
                block = (line.strip()[3:].strip(), [])
            else:
                blocks.append(block)
                block = None
        elif block is not None:
            block[1].append((number, line))
    return blocks
