"""Every relative link and every ``#anchor`` in the documentation resolves, as GitHub renders it.

Checked: README.md, docs/**/*.md (not the run directories under docs/results/shapes_runs/ and
demo_run*/) and the paths named in the comments of configs/**/*.yaml. A link into a .md file
with an anchor must name one of its heading slugs (GitHub's rule, ``heading_slug``) or an
explicit ``id=``/``name=`` anchor; anchors into other files (``#L10`` into a .py) are not checked.
"""

from __future__ import annotations

import difflib
import html
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
# Run directories: written by the tools, their links are not documentation.
SKIP_DIRS = ("docs/results/shapes_runs/",)
SKIP_DIR_PREFIX = "demo_run"
# Folders never searched for a did-you-mean of a moved file.
NOT_SOURCES = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
# A code span: a backtick run, then the shortest text up to a run of the same length, never
# across a blank line (that ends the paragraph).
CODE_SPAN = re.compile(r"(?<![`\\])(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)
REFERENCE_DEF = re.compile(r"^ {0,3}\[(?:[^\]\\]|\\.)+\]:[ \t]*(<[^>]*>|\S+)")
EXPLICIT_ANCHOR = re.compile(
    r"""<a\b[^>]*?\bname\s*=\s*["']([^"']+)["']|\bid\s*=\s*["']([^"']+)["']"""
)
SCHEME = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")
# In a YAML comment: a path to a .md file (with an optional #anchor) or to a config.
YAML_REF = re.compile(
    r"(?<![\w./*$-])((?:\.{1,2}/)*[\w.-]+(?:/[\w.-]+)*\.md)(#[\w-]+)?(?![\w/*])"
    r"|(?<![\w./*$-])(configs/[\w.-]+(?:/[\w.-]+)*\.ya?ml)(?![\w/*])"
)


@dataclass(frozen=True)
class Link:
    """One link of a file: where it stands and what it points at."""

    line: int
    target: str


def heading_slug(text: str) -> str:
    """GitHub's anchor for a heading's rendered text: lowercase, only word characters, spaces
    and hyphens kept, each space a hyphen (``[^\\p{Word}\\- ]`` removed, as html-pipeline and
    github-slugger do; repeated hyphens are not collapsed)."""
    kept = (c for c in text.lower() if c in " -" or _is_word(c))
    return "".join(kept).replace(" ", "-")


def _is_word(char: str) -> bool:
    """Whether a character is in Ruby's ``\\p{Word}``: a letter, mark, digit or connector."""
    category = unicodedata.category(char)
    return category[0] in "LM" or category in ("Nd", "Nl", "Pc")


def rendered_heading(source: str) -> str:
    """The text a heading's markdown source renders to: code spans keep their content, links
    keep their text, images, HTML tags and emphasis markers go."""
    parts = []
    position = 0
    for span in CODE_SPAN.finditer(source):
        parts.append(_render_inline(source[position : span.start()]))
        code = span.group(2)
        if code.startswith(" ") and code.endswith(" ") and code.strip():
            code = code[1:-1]  # CommonMark strips one space each side
        parts.append(code)
        position = span.end()
    parts.append(_render_inline(source[position:]))
    return "".join(parts).strip()


def _render_inline(text: str) -> str:
    """Inline markdown outside code spans, rendered to its plain text."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)  # an image has no text of its own
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", text)
    text = re.sub(r"<(https?://[^>]+)>", r"\1", text)
    text = re.sub(r"</?[A-Za-z][^>]*>", "", text)
    text = re.sub(r"\*+", "", text)
    # `_` emphasis opens after a non-word character and closes before one; `snake_case` stays.
    previous = None
    while previous != text:
        previous = text
        text = re.sub(r"(?<!\w)(_+)(?=\S)(.+?)(?<=\S)\1(?!\w)", r"\2", text)
    text = re.sub(r"~~(.+?)~~", r"\1", text)
    text = re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)
    return html.unescape(text)


def _blank(match: re.Match[str]) -> str:
    """A match replaced by spaces, its newlines kept, so that lines and columns stay."""
    return re.sub(r"[^\n]", " ", match.group(0))


def unfenced_lines(text: str) -> list[str]:
    """A markdown file's lines with fenced code blocks and HTML comments blanked."""
    lines = text.split("\n")
    fence: str | None = None
    for number, line in enumerate(lines):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
            lines[number] = ""
        elif fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                if not line.strip().strip(fence[0]):
                    fence = None
            lines[number] = ""
    return HTML_COMMENT.sub(_blank, "\n".join(lines)).split("\n")


def prose_lines(text: str) -> list[str]:
    """A markdown file's lines with fenced code blocks, HTML comments and code spans blanked."""
    return CODE_SPAN.sub(_blank, "\n".join(unfenced_lines(text))).split("\n")


def _destination(line: str, start: int) -> str | None:
    """The destination of an inline link whose ``(`` is at ``start``, or None if none closes."""
    position = start + 1
    while position < len(line) and line[position] in " \t":
        position += 1
    if line.startswith("<", position):
        end = line.find(">", position)
        if end < 0:
            return None
        target, position = line[position + 1 : end], end + 1
    else:
        depth, begin = 0, position
        while position < len(line) and not line[position].isspace():
            char = line[position]
            if char == "\\":
                position += 1
            elif char == "(":
                depth += 1
            elif char == ")":
                if depth == 0:
                    break
                depth -= 1
            position += 1
        target = line[begin:position]
    rest = line[position:].lstrip()
    if rest.startswith(")"):
        return target
    title = re.match(r"""("[^"]*"|'[^']*'|\([^)]*\))\s*\)""", rest)
    return target if title else None


def markdown_links(text: str) -> list[Link]:
    """Inline links, images and reference definitions of a markdown file, outside code."""
    links = []
    for number, line in enumerate(prose_lines(text), start=1):
        definition = REFERENCE_DEF.match(line)
        if definition:
            links.append(Link(number, definition.group(1).strip("<>")))
            continue
        for opening in re.finditer(r"\]\(", line):
            target = _destination(line, opening.end() - 1)
            if target is not None:
                links.append(Link(number, target))
    return links


def yaml_comment(line: str) -> str:
    """The comment of a YAML line (after a ``#`` that starts one, outside quotes), or ''."""
    quote: str | None = None
    for position, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"" and (position == 0 or line[position - 1] in " \t:[{,-"):
            quote = char
        elif char == "#" and (position == 0 or line[position - 1] in " \t"):
            return line[position + 1 :]
    return ""


def yaml_links(text: str) -> list[Link]:
    """The .md and config paths named in a YAML file's comments, from the repository root (a
    bare name with no folder may also be a sibling of a path named on the same line)."""
    links = []
    for number, line in enumerate(text.split("\n"), start=1):
        for found in YAML_REF.finditer(yaml_comment(line)):
            path = found.group(3) or found.group(1)
            if "/" not in path and not (REPO / path).exists():
                path = _sibling(path, line)
            links.append(Link(number, "/" + path + (found.group(2) or "")))
    return links


def _sibling(name: str, line: str) -> str:
    """``name`` in the folder of a path named on the line (``rendered to shapes_notes.md``
    beside ``docs/results/shapes_notes.template.md``), if one holds it; else ``name``."""
    for named in re.findall(r"[\w.-]+(?:/[\w.-]+)+", line):
        candidate = Path(named).parent / name
        if (REPO / candidate).exists():
            return candidate.as_posix()
    return name


@cache
def anchors(path: Path) -> tuple[str, ...]:
    """Every anchor a markdown file offers: its heading slugs (de-duplicated in order with
    ``-1``, ``-2``, ... as GitHub does) and its explicit ``name=``/``id=`` anchors."""
    seen: set[str] = set()
    counts: dict[str, int] = {}
    found = []
    text = path.read_text(encoding="utf-8")
    for line, prose in zip(unfenced_lines(text), prose_lines(text), strict=True):
        heading = ATX_HEADING.match(line)
        if heading:
            slug = base = heading_slug(rendered_heading(heading.group(2) or ""))
            while slug in seen:
                counts[base] = counts.get(base, 0) + 1
                slug = f"{base}-{counts[base]}"
            seen.add(slug)
            found.append(slug)
        for explicit in EXPLICIT_ANCHOR.finditer(prose):
            found.append(explicit.group(1) or explicit.group(2))
    return tuple(found)


@cache
def _files_by_name() -> dict[str, tuple[str, ...]]:
    """The repository's files by their name, for a did-you-mean of a moved file."""
    by_name: dict[str, list[str]] = {}
    for path in _walk(REPO):
        by_name.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    return {name: tuple(sorted(paths)) for name, paths in by_name.items()}


def _walk(folder: Path) -> Iterator[Path]:
    """Every file under a folder, the tool and cache folders left out."""
    for entry in folder.iterdir():
        if entry.is_dir():
            if entry.name not in NOT_SOURCES:
                yield from _walk(entry)
        else:
            yield entry


def _moved_hint(resolved: Path) -> str:
    """'; did you mean X?' naming the files of that name nearest the intended path (two at
    most: a README.md has many), or the closest name in the intended folder; or ''."""
    intended = resolved.relative_to(REPO).as_posix()
    elsewhere = _files_by_name().get(resolved.name, ())
    if elsewhere:
        nearest = sorted(
            elsewhere, key=lambda p: -difflib.SequenceMatcher(None, intended, p).ratio()
        )
        return f"; did you mean {' or '.join(nearest[:2])}?"
    parent = resolved.parent
    if parent.is_dir():
        close = difflib.get_close_matches(resolved.name, [p.name for p in parent.iterdir()], 1)
        if close:
            return f"; did you mean {(parent / close[0]).relative_to(REPO).as_posix()}?"
    return ""


def problem(source: Path, target: str) -> str | None:
    """Why a link of ``source`` does not resolve on GitHub, or None if it does (or is not ours
    to check: a URL with a scheme, an empty link)."""
    if not target or SCHEME.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    path_part, query_mark, _ = path_part.partition("?")
    path_part = unquote(path_part)
    if not path_part:
        resolved = source
    elif path_part.startswith("/"):
        resolved = REPO / path_part.lstrip("/")
    else:
        resolved = source.parent / path_part
    resolved = Path(*_normalised(resolved.parts))
    if not resolved.is_relative_to(REPO):
        return "missing file: outside the repository"
    if not resolved.exists():
        return f"missing file {resolved.relative_to(REPO).as_posix()}{_moved_hint(resolved)}"
    if not anchor or query_mark:
        return None
    if resolved.is_dir():
        resolved = resolved / "README.md"  # GitHub renders a folder's README below it
        if not resolved.is_file():
            return None
    if resolved.suffix.lower() != ".md":
        return None
    anchor = unquote(anchor)
    offered = anchors(resolved)
    if anchor in offered:
        return None
    where = resolved.relative_to(REPO).as_posix()
    close = difflib.get_close_matches(anchor, offered, 1, 0.5)
    hint = f"; did you mean #{close[0]}?" if close else ""
    return f"no such anchor in {where}{hint}"


def _normalised(parts: tuple[str, ...]) -> list[str]:
    """Path parts with ``.`` and ``..`` applied (without following links, as GitHub does)."""
    kept: list[str] = []
    for part in parts:
        if part == "..":
            if len(kept) > 1:
                kept.pop()
        elif part != ".":
            kept.append(part)
    return kept


def documentation_files() -> list[Path]:
    """README.md, docs/**/*.md without the run directories, and configs/**/*.yaml."""
    files = [REPO / "README.md"]
    for path in sorted((REPO / "docs").rglob("*.md")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(SKIP_DIRS):
            continue
        if any(part.startswith(SKIP_DIR_PREFIX) for part in path.relative_to(REPO).parts[:-1]):
            continue
        files.append(path)
    files += sorted((REPO / "configs").rglob("*.yaml"))
    return files


def broken_links(path: Path) -> list[str]:
    """``file:line: target (why)`` for every link of a documentation file that does not resolve."""
    text = path.read_text(encoding="utf-8")
    links = yaml_links(text) if path.suffix == ".yaml" else markdown_links(text)
    relative = path.relative_to(REPO).as_posix()
    broken = []
    for link in links:
        why = problem(path, link.target)
        if why:
            shown = link.target.lstrip("/") if path.suffix == ".yaml" else link.target
            broken.append(f"{relative}:{link.line}: {shown} ({why})")
    return broken


FILES = documentation_files()


def test_the_documentation_is_found() -> None:
    """The file list is not silently empty (a moved docs/ folder would pass every check)."""
    names = {path.relative_to(REPO).as_posix() for path in FILES}
    assert "README.md" in names
    assert any(name.startswith("docs/") for name in names)
    assert any(name.startswith("configs/") for name in names)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_resolves(path: Path) -> None:
    """Each relative link and #anchor of a documentation file points at something that exists."""
    if not path.exists():
        pytest.skip(f"{path.relative_to(REPO)} was moved or removed since collection")
    broken = broken_links(path)
    if broken:
        pytest.fail(f"{len(broken)} broken link(s):\n" + "\n".join(broken), pytrace=False)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        (
            "What has run on a GPU (status on 2026-11-26)",
            "what-has-run-on-a-gpu-status-on-2026-11-26",
        ),
        ("The `--pooler` mode", "the---pooler-mode"),
        (
            "Fused packs and masks (opt-in: `DROPIT_FUSE=1`)",
            "fused-packs-and-masks-opt-in-dropit_fuse1",
        ),
        ("Every saved activation, in any model", "every-saved-activation-in-any-model"),
        ("The forward's working set", "the-forwards-working-set"),
        ("Under torch.compile", "under-torchcompile"),
        ("A  B", "a--b"),
        ("Привет non-latin 你好", "привет-non-latin-你好"),
        ("😄 emoji", "-emoji"),
        (
            "**Bold** and _emphasis_ in `snake_case` and plain snake_case",
            "bold-and-emphasis-in-snake_case-and-plain-snake_case",
        ),
        ("See [the guide](docs/x.md) <sup>1</sup>", "see-the-guide-1"),
        ("Δ box AP & mask AP", "δ-box-ap--mask-ap"),
    ],
)
def test_heading_slug_follows_github(heading: str, slug: str) -> None:
    """Heading slugs are GitHub's: punctuation dropped, spaces to hyphens, nothing collapsed."""
    assert heading_slug(rendered_heading(heading)) == slug


def test_repeated_headings_get_numbered_slugs(tmp_path: Path) -> None:
    """A repeated heading's slug gets -1, -2 in order; headings inside fences make none."""
    page = tmp_path / "page.md"
    page.write_text("# Notes\n## Notes\n```\n# Notes\n```\n### Notes\n# Notes 1\n")
    assert anchors(page) == ("notes", "notes-1", "notes-2", "notes-1-1")


def test_links_in_code_are_not_links() -> None:
    """Links in fenced blocks and code spans are skipped; titles and nested parens are read."""
    text = (
        "[a](a.md) `[b](b.md)` ![c](c.png 'title')\n"
        "```\n[d](d.md)\n```\n"
        "[e](e_(1).md) [f]: f.md\n"
        "[g]: <g g.md>\n"
    )
    assert [link.target for link in markdown_links(text)] == ["a.md", "c.png", "e_(1).md", "g g.md"]


def test_yaml_comments_name_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths in YAML comments are links from the repository root; globs and values are not."""
    monkeypatch.setitem(globals(), "REPO", tmp_path)  # a sibling is looked up on disk
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "shapes_notes.md").touch()
    text = (
        "notes: docs/results/shapes_notes.template.md  # rendered to shapes_notes.md\n"
        "# see docs/choosing.md#some-anchor and README.md.\n"
        "key: docs/not_a_comment.md  # configs/base.yaml, configs/maskrcnn_*.yaml\n"
    )
    found = [(link.line, link.target) for link in yaml_links(text)]
    assert found == [
        (1, "/docs/results/shapes_notes.md"),
        (2, "/docs/choosing.md#some-anchor"),
        (2, "/README.md"),
        (3, "/configs/base.yaml"),
    ]
