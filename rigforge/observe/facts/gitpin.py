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
        state: Checkout = {"head": "", "url": "", "sparse": False, "patterns": [], "dirty": [], "files": {}}
        for line in output:
            key, _, value = line.partition("=")
            if key == "head":
                state["head"] = value.strip()
            elif key == "url":
                state["url"] = value.strip()
            elif key == "sparse":
                state["sparse"] = value.strip() == "true"
            elif key == "pattern" and value.strip():
                state["patterns"].append(value.strip())
            elif key == "dirty":
                state["dirty"].append(value)
            elif key == "file":  # sha256sum's "<digest>  <path>"
                digest, _, name = value.partition("  ")
                state["files"][name.strip()] = digest.strip()
        return state
