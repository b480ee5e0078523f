"""Fact: the state of a pinned git checkout on the host (HEAD, origin, dirtiness, sparse patterns, file hashes)."""

import shlex
from typing import TypedDict

from pyinfra.api import FactBase


class Checkout(TypedDict):
    """What GitCheckout reads of a checkout."""

    head: str  # HEAD's 40-hex commit, "" before the first checkout
    url: str  # remote.origin.url
    sparse: bool  # core.sparseCheckout
    patterns: list[str]  # .git/info/sparse-checkout's lines
    dirty: list[str]  # `git status --porcelain --untracked-files=all` lines
    files: dict[str, str]  # {path: sha256} of the asked `files` found


class GitCheckout(FactBase[Checkout | None]):
    """``None`` when ``path`` holds no git checkout, else ``{"head": "<40-hex or ''>", "url": "...", "sparse": bool,
    "patterns": [...], "dirty": [git status --porcelain lines], "files": {path: sha256 of those of `files` found}}``."""

    def command(self, path: str, files: tuple[str, ...] | list[str] = ()) -> str:
        hashes = " ".join(shlex.quote(f) for f in files)
        return (
            f"cd {shlex.quote(path)} 2>/dev/null && [ -d .git ] || {{ echo absent; exit 0; }}; "
            'echo "head=$(git rev-parse -q --verify HEAD 2>/dev/null)"; '
            'echo "url=$(git config --get remote.origin.url)"; '
            'echo "sparse=$(git config --bool core.sparseCheckout)"; '
            "sed 's/^/pattern=/' .git/info/sparse-checkout 2>/dev/null; "
            "git status --porcelain --untracked-files=all 2>/dev/null | sed 's/^/dirty=/'; "
            + (f"sha256sum -- {hashes} 2>/dev/null | sed 's/^/file=/'; " if files else "")
            + "true"
        )

    def process(self, output: list[str]) -> Checkout | None:
        if not output or output[0].strip() == "absent":
            return None
        pairs = [line.partition("=")[::2] for line in output]
        last = dict(pairs)
        return {
            "head": last.get("head", "").strip(),
            "url": last.get("url", "").strip(),
            "sparse": last.get("sparse", "").strip() == "true",
            "patterns": [value.strip() for key, value in pairs if key == "pattern" and value.strip()],
            "dirty": [value for key, value in pairs if key == "dirty"],
            "files": {
                n.strip(): d.strip() for d, _, n in (value.partition("  ") for key, value in pairs if key == "file")
            },
        }
