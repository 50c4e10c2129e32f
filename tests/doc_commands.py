"""The shell commands README.md and docs/*.md show, as a reader would copy them.

* fenced blocks marked ``bash``, ``sh``, ``shell`` or ``console``: every line is a command
  (``\\`` continuations joined, ``# comments`` and a ``$ `` prompt dropped);
* other fenced blocks (no language) and inline code spans: the text that starts like a command
  (``make``, ``spark-submit``, ``python``, ``.venv/bin/...``, ``pip``, ``bash``) and has an argument.

Blocks in ``python``, ``yaml``, ``json``, ``text`` are not commands.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SHELL_LANGS = {"bash", "sh", "shell", "console"}
NOT_SHELL = {"python", "py", "yaml", "yml", "json", "text", "toml", "ini", "properties"}
COMMAND_START = re.compile(r"^(?:make|spark-submit|python3?|\.venv/bin/\S+|pip3?|bash)\s+\S")
FENCE = re.compile(r"^(```+|~~~+)[ \t]*([\w-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")


@dataclass(frozen=True)
class DocCommand:
    command: str        # whitespace-normalised, as the test lists it
    source: str         # "docs/x.md:12"

    @property
    def id(self) -> str:
        return f"{self.source} {self.command[:60]}"


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def normalise(command: str) -> str:
    return " ".join(command.split())


def _logical_lines(body: str) -> list[tuple[int, str]]:
    """(offset of the first line, text) with ``\\`` continuations joined and comments dropped."""
    out, buf, start = [], "", 0
    for i, raw in enumerate(body.splitlines()):
        line = strip_comment(raw)
        if not buf:
            start = i
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            out.append((start, buf.strip()))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def commands_in(path: Path, root: Path) -> list[DocCommand]:
    text = path.read_text()
    rel = path.relative_to(root)
    found: list[DocCommand] = []
    fenced_spans = []
    for m in FENCE.finditer(text):
        fenced_spans.append((m.start(), m.end()))
        lang = m.group(2).lower()
        if lang in NOT_SHELL:
            continue
        first = text[: m.start(3)].count("\n") + 1
        for off, line in _logical_lines(m.group(3)):
            line = line[2:] if line.startswith("$ ") else line
            if lang in SHELL_LANGS or COMMAND_START.match(line):
                found.append(DocCommand(normalise(line), f"{rel}:{first + off}"))
    for m in INLINE.finditer(text):
        if any(a <= m.start() < b for a, b in fenced_spans):
            continue
        span = normalise(m.group(1))
        if COMMAND_START.match(span):
            found.append(DocCommand(span, f"{rel}:{text[: m.start()].count(chr(10)) + 1}"))
    return found


def all_commands(root: Path) -> list[DocCommand]:
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [c for p in pages for c in commands_in(p, root)]


def is_template(command: str) -> bool:
    """A pattern to fill in, not a command: ``<placeholder>``, a ``...`` argument, ``[--option X]``."""
    return (bool(re.search(r"<[\w .-]+>", command)) or bool(re.search(r"(^|\s)\.\.\.(\s|$)", command))
            or bool(re.search(r"\[--[\w-]+", command)))   # [--optional ARG] notation
