"""File facts pyinfra does not have: a JSON file's content, the size of a tree."""

import json
from typing import Any

from pyinfra.api import FactBase, QuoteString, StringCommand


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object `text` holds; None when it is not JSON or holds something other than an object."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class JsonFile(FactBase[dict[str, Any] | None]):
    """The JSON object in the file at ``path`` (`json_object`); None also when the file is missing or unreadable."""

    def command(self, path: str) -> StringCommand:
        return StringCommand("cat", QuoteString(path), "2>/dev/null || true")

    def process(self, output: list[str]) -> dict[str, Any] | None:
        return json_object("\n".join(output))


class TreeSize(FactBase[int | None]):
    """The bytes the tree at ``path`` takes on disk (``du -sb``); None when there is no such path."""

    def command(self, path: str) -> StringCommand:
        return StringCommand("du", "-sb", QuoteString(path), "2>/dev/null", "|", "cut", "-f1", "||", "true")

    def process(self, output: list[str]) -> int | None:
        text = "".join(output).strip()
        return int(text) if text.isdigit() else None
