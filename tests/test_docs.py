"""The docs cannot drift: the CLI reference is the parsers' own text, every relative link and anchor resolves."""

import re
from pathlib import Path

import pytest
from doc_pages import PAGES, ROOT, prose_lines

from ds_packdpo.cli_reference import COMMAND_PARSERS, DOC_PATH, render

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def test_cli_reference_is_generated_from_the_parsers():
    assert DOC_PATH.read_text() == render(), \
        "docs/cli.md differs from the parsers: run `python -m ds_packdpo.cli_reference --write`"


def _section(text: str, command: str) -> str:
    return text.split(f"## `ds-packdpo {command}`")[1].split("\n## ")[0]


def test_each_command_section_lists_its_own_flags_and_says_what_it_does():
    """export's --dtype, --max-shard-size, --overwrite, --trust-remote-code and report's --overwrite were missing
    (named like training flags, they were taken for them though neither command takes those), and eval's section
    described train (its description and train's --dry-run epilog)."""
    text = render()
    for command, parser, _ in COMMAND_PARSERS:
        section = _section(text, command)
        if "[training flags]" not in section:
            for action in parser._actions:
                for name in action.option_strings:
                    if name not in ("-h", "--help"):
                        assert f"`{name}" in section, f"{command}: {name} is not in docs/cli.md"
    assert "| `--dtype {fp32,bf16}` | - |" in _section(text, "export")  # the parser's default, not train's 'auto'
    assert "--dry-run" not in _section(text, "eval") and "evaluated against its reference" in _section(text, "eval")


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to dashes, -N on
    repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose_lines(page):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    return [m.group(1) or m.group(2) for line in prose_lines(page) for m in LINK.finditer(line)]


def test_github_anchor_rules():
    page = ROOT / "tests" / "_anchor_probe.md"
    page.write_text("# A `code` title: with, punctuation!\n## Twice\n## Twice\n```\n# not a heading\n```\n")
    try:
        assert github_anchors(page) == {"a-code-title-with-punctuation", "twice", "twice-1"}
    finally:
        page.unlink()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto: - not checked offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_getting_started_quotes_the_plan_line_make_demo_prints_today(tmp_path, no_launch, capsys):
    """getting-started quoted a stale demo plan line (58 steps, no prompt groups): the Makefile's demo flags, planned
    here (--dry-run plans as the run does), print the line the page quotes."""
    import shlex

    from ds_packdpo import cli

    recipe = (ROOT / "Makefile").read_text().split("ds-packdpo train ", 1)[1].split("\n\t$(PY)", 1)[0]
    flags = shlex.split(recipe.replace("\\\n", " "))
    flags[flags.index("--output-dir") + 1] = str(tmp_path / "demo")
    assert cli.main(["train", *flags, "--cache-dir", str(tmp_path / "cache"), "--num-procs", "2", "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    page = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    quoted = re.search(r"its first line `(plan: [^`]*)`", page).group(1)
    assert quoted == printed
