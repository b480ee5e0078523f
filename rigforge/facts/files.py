"""File facts pyinfra does not have: a JSON file's content, the size of a tree."""

from __future__ import annotations

import json

from pyinfra.api import FactBase, QuoteString, StringCommand


class JsonFile(FactBase):
    """The JSON object in the file at ``path``; None when the file is missing, unreadable, not JSON, or holds
    something other than an object."""

    def command(self, path: str) -> StringCommand:
        return StringCommand("cat", QuoteString(path), "2>/dev/null || true")

    def process(self, output: list[str]) -> dict | None:
        try:
            value = json.loads("\n".join(output))
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


class TreeSize(FactBase):
    """The bytes the tree at ``path`` takes on disk (``du -sb``); None when there is no such path."""

    def command(self, path: str) -> StringCommand:
        return StringCommand("du", "-sb", QuoteString(path), "2>/dev/null", "|", "cut", "-f1", "||", "true")

    def process(self, output: list[str]) -> int | None:
        text = "".join(output).strip()
        return int(text) if text.isdigit() else None
