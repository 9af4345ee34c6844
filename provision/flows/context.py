"""The build context of the trainer image: the files `docker build` would send, as a tar.

`context_files` applies .dockerignore the way Docker does (the last matching pattern wins, a
`!pattern` can re-include); `context_tar` writes them as a tar with owners and float mtimes
normalised, and returns a digest of names, modes and contents: the label that lets `ship: build`
skip a node whose image was built from the same context.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from pathlib import Path
from typing import IO

from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError

CHUNK = 1 << 20


def source_tree() -> Path:
    return Path(__file__).resolve().parents[2]  # provision/flows/context.py -> the source tree


def build_context(cfg: GpuctlConfig) -> tuple[Path, str]:
    """(context folder, Dockerfile path relative to it) from config `docker`."""
    context = Path(cfg.docker.context).expanduser() if cfg.docker.context else source_tree()
    if not context.is_absolute():
        context = (cfg.base_dir / context).resolve()
    if not (context / cfg.docker.dockerfile).is_file():
        raise ConfigError(
            f"no {cfg.docker.dockerfile} in {context}",
            "set docker.context to a folder with the Dockerfile (gpuctl's source tree)",
        )
    return context, cfg.docker.dockerfile


_IgnoreRule = tuple[re.Pattern[str], int, bool, str]


def _ignore_rules(context: Path) -> list[_IgnoreRule]:
    """.dockerignore -> (regex, path components, negated, literal prefix), in file order."""
    path = context / ".dockerignore"
    rules: list[_IgnoreRule] = []
    for raw in path.read_text().splitlines() if path.is_file() else []:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = "".join(
            r"(?:.*/)?"
            if part == "**/"
            else ".*"
            if part == "**"
            else "[^/]*"
            if part == "*"
            else "[^/]"
            if part == "?"
            else re.escape(part)
            for part in re.findall(r"\*\*/|\*\*|\*|\?|[^*?]+", pattern)
        )
        prefix = re.split(r"[*?\[]", pattern)[0]
        rules.append((re.compile(regex, re.S), len(pattern.split("/")), negate, prefix))
    return rules


def _ignored(rel: str, rules: list[_IgnoreRule]) -> bool:
    """Docker's rule: the last pattern matching the path, or one of its parent folders, wins."""
    parts = rel.split("/")
    verdict = False
    for regex, depth, negate, _ in rules:
        if regex.fullmatch(rel) or (depth < len(parts) and regex.fullmatch("/".join(parts[:depth]))):
            verdict = not negate
    return verdict


def context_files(context: Path, dockerfile: str) -> list[str]:
    """Relative paths of the files a `docker build` of context sends, sorted."""
    rules = _ignore_rules(context)
    negations = [prefix for *_, negate, prefix in rules if negate]
    found = {p for p in (dockerfile, ".dockerignore") if (context / p).is_file()}
    for folder, dirs, files in os.walk(context):
        base = os.path.relpath(folder, context)
        base = "" if base == "." else base + "/"
        # skip an ignored folder unless a `!pattern` could re-include something inside it
        dirs[:] = [
            d
            for d in dirs
            if not _ignored(base + d, rules)
            or any(not p or p.startswith(base + d + "/") or (base + d).startswith(p) for p in negations)
        ]
        found.update(base + f for f in files if not _ignored(base + f, rules))
    return sorted(found)


def context_tar(context: Path, dockerfile: str, out: IO[bytes]) -> str:
    """Write the build context as a tar to `out`; return a digest of its contents and modes."""
    digest = hashlib.sha256()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for rel in context_files(context, dockerfile):
            path = context / rel
            info = tar.gettarinfo(str(path), arcname=rel)
            info.uid = info.gid = 0
            info.mtime = int(info.mtime)  # a float mtime makes a PAX header that docker's tar sniffing rejects
            info.uname = info.gname = ""
            digest.update(f"{rel}\0{info.mode & 0o111:o}\0{info.size}\0".encode())
            if info.isfile():
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
                with open(path, "rb") as fh:
                    for block in iter(lambda: fh.read(CHUNK), b""):
                        digest.update(block)
            else:
                tar.addfile(info)
                digest.update(os.readlink(path).encode() if info.issym() else b"")
    return digest.hexdigest()
