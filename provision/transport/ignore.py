"""What put_dir ships: a folder minus what its .gitignore / .gpuctlignore files exclude.

``walk_shipped(root)`` yields (relative path, local path, 'dir'|'file'|'link'), parents
first. The matcher follows gitignore: globs with ``*``, ``?``, ``[...]`` and ``**``; a
leading ``!`` negates, a trailing ``/`` matches folders only, a ``/`` inside anchors the
pattern to the ignore file's folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

IGNORE_FILES = (".gitignore", ".gpuctlignore")


@dataclass
class IgnoreRule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _glob_to_regex(glob: str) -> str:
    """gitignore glob -> regex over a '/'-separated relative path."""
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append(r"(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out.append(r"/.*")
            i += 3
        elif glob.startswith("**", i):
            out.append(r".*")
            i += 2
        elif c == "*":
            out.append(r"[^/]*")
            i += 1
        elif c == "?":
            out.append(r"[^/]")
            i += 1
        elif c == "[":
            end = glob.find("]", i + 2)
            if end == -1:
                out.append(re.escape(c))
                i += 1
            else:
                body = glob[i + 1 : end].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end + 1
        elif c == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def parse_ignore(text: str) -> list[IgnoreRule]:
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        if line.startswith("\\"):
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        body = _glob_to_regex(line.lstrip("/"))
        pattern = body if anchored else r"(?:.*/)?" + body
        rules.append(IgnoreRule(re.compile(rf"^{pattern}$", re.S), negate, dir_only))
    return rules


def walk_shipped(root: Path) -> Iterator[tuple[str, Path, str]]:
    """(relative path, local path, 'dir'|'file'|'link') for what put_dir ships, parents first.

    Ignore files in any folder apply below it, as git does; the last matching rule wins, and
    an ignored folder is skipped whole.
    """

    def rules_in(folder: Path, prefix: str) -> list[tuple[str, IgnoreRule]]:
        found = []
        for name in IGNORE_FILES:
            path = folder / name
            if path.is_file():
                found += [(prefix, rule) for rule in parse_ignore(path.read_text(errors="replace"))]
        return found

    def ignored(rel: str, is_dir: bool, rules: list[tuple[str, IgnoreRule]]) -> bool:
        verdict = False
        for prefix, rule in rules:
            if prefix and not rel.startswith(prefix + "/"):
                continue
            sub = rel[len(prefix) + 1 :] if prefix else rel
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(sub):
                verdict = not rule.negate
        return verdict

    def walk(folder: Path, prefix: str, rules: list[tuple[str, IgnoreRule]]) -> Iterator[tuple[str, Path, str]]:
        rules = rules + rules_in(folder, prefix)
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            rel = f"{prefix}/{entry.name}" if prefix else entry.name
            path = Path(entry.path)
            if entry.is_symlink():
                if not ignored(rel, False, rules):
                    yield rel, path, "link"
            elif entry.is_dir():
                if not ignored(rel, True, rules):
                    yield rel, path, "dir"
                    yield from walk(path, rel, rules)
            elif entry.is_file() and not ignored(rel, False, rules):
                yield rel, path, "file"

    yield from walk(Path(root), "", [])
