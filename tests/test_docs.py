"""The README and docs/ as a reader meets them: tables render (a header, a separator, rows of the header's width, no
row cut off by a blank line), relative links and anchors resolve, the README stays a short guide, and every
`python -m hf_vla.<command>` line in them names flags the command has and config files that exist (the walkthrough's
commands also run: tests/test_readme.py)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _prose(text: str) -> str:
    """The text with fenced code blocks blanked (their lines kept, so line numbers stay)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _cells(row: str) -> list[str]:
    """A table row's cells as GitHub splits them: on `|` not escaped with a backslash (also inside code spans)."""
    body = row.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return re.split(r"(?<!\\)\|", body)


def tables(text: str) -> list[tuple[int, list[str]]]:
    """Each run of consecutive table lines (`|`-led), with its first line number."""
    found, current, start = [], [], 0
    for number, line in enumerate(_prose(text).splitlines(), 1):
        if line.lstrip().startswith("|"):
            if not current:
                start = number
            current.append(line)
        elif current:
            found.append((start, current))
            current = []
    if current:
        found.append((start, current))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_tables_render(page):
    for start, rows in tables(page.read_text()):
        where = f"{page.relative_to(REPO)}:{start}"
        assert len(rows) >= 2, f"{where}: a table line without a header (a blank line inside a table?)"
        width = len(_cells(rows[0]))
        separator = _cells(rows[1])
        assert all(re.fullmatch(r"\s*:?-{3,}:?\s*", cell) for cell in separator), \
            f"{where}: the second line is not a header separator (a table split by a blank line?): {rows[1][:80]}"
        assert len(separator) == width, f"{where}: separator has {len(separator)} cells, header {width}"
        for offset, row in enumerate(rows[2:], 2):
            assert len(_cells(row)) == width, \
                f"{where}: row {offset + 1} has {len(_cells(row))} cells, header {width} (an unescaped |?): {row[:100]}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    text = _prose(page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.relative_to(REPO)}: link to {target!r}, which does not exist"
        if anchor and linked.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", _prose(linked.read_text()), re.M)}
            assert anchor in headings, f"{page.relative_to(REPO)}: link to {target!r}: no such heading in {path}"


def test_the_readme_is_a_short_guide():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md: reference material and measurements go to docs/"
    for page in re.findall(r"\]\((docs/[\w.]+)\)", text):
        assert (REPO / page).exists(), page
    linked = set(re.findall(r"\]\(docs/([\w.]+)", text))
    unlinked = {p.name for p in (REPO / "docs").glob("*.md")} - linked
    assert not unlinked, f"docs pages the README does not link: {sorted(unlinked)}"


def _help(command: str) -> str:
    """What `python -m hf_vla.<command> --help` prints, in-process."""
    if command in ("train", "rl"):
        text = importlib.import_module("hf_vla.train").help_text()
        if command == "rl":
            text += importlib.import_module("hf_vla.rl.__main__").help_text()
        return text
    module = importlib.import_module(f"hf_vla.{command}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(["--help"])
    return out.getvalue()


def command_lines(text: str):
    """`python -m hf_vla.X ...` commands of the page's bash blocks (continuations joined, comments dropped)."""
    for language, block in FENCE.findall(text):
        if language not in ("bash", "sh", ""):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip().rstrip("&").strip()
            match = re.search(r"(?:^|\s)-m (hf_vla(?:\.\w+)*)\s*(.*)", line)
            if match and line.lstrip().split()[0] in ("python", "srun", "accelerate", "torchrun", "OMP_NUM_THREADS=1"):
                yield match.group(1), match.group(2)


def test_documented_commands_name_real_flags_and_files():
    helps, checked = {}, 0
    for page in PAGES:
        for module, rest in command_lines(page.read_text()):
            command = module.removeprefix("hf_vla").lstrip(".") or "__main__"
            if command == "__main__":
                continue
            try:
                argv = shlex.split(rest)
            except ValueError:  # a line with an elided argument ('[...]'): its flags are still checked below
                argv = rest.split()
            if command not in helps:
                helps[command] = _help(command)
            for arg in argv:
                if arg == "..." or not arg.startswith("--"):
                    if arg.startswith("configs/") and arg.endswith(".json"):
                        assert (REPO / arg).exists(), f"{page.name}: {module} {arg}: no such config"
                    continue
                flag = arg.split("=")[0].split(".")[0]
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])|(?<![\w-]){re.escape(flag[2:])}(?![\w-])",
                                 helps[command]), f"{page.relative_to(REPO)}: python -m {module} has no {flag}"
                checked += 1
    assert checked > 50  # the pages do hold commands: the parse found them


def test_config_comments_are_short():
    """A config's `//` says what it is for and the command that uses it; the why and the numbers live in
    docs/configs.md."""
    import json

    for path in sorted((REPO / "configs").rglob("*.json")):
        comment = json.loads(path.read_text()).get("//", "")
        assert len(comment) <= 300, f"{path.relative_to(REPO)}: a {len(comment)}-character comment; move it to docs"


def test_dataset_fields_doc_is_generated_from_the_dataclass():
    """docs/dataset_fields.md lists every field of a `datasets` entry with its docstring text; a field added or
    re-documented without regenerating the page fails here (the command is in the page)."""
    import dataclasses

    from hf_vla.data.dataset_config import DatasetConfig, field_docs, fields_markdown

    assert (REPO / "docs" / "dataset_fields.md").read_text() == fields_markdown()
    docs = field_docs()
    assert all(docs.get(f.name, "").strip() for f in dataclasses.fields(DatasetConfig)), \
        sorted({f.name for f in dataclasses.fields(DatasetConfig)} - set(docs))
    assert "docs/dataset_fields.md" in __import__("hf_vla.train", fromlist=["help_text"]).help_text()
