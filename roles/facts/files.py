"""File facts pyinfra does not have: a JSON file's content, and a file's sha256 without some of its lines."""

from __future__ import annotations

import json

from pyinfra.api import FactBase, QuoteString, StringCommand


class JsonFile(FactBase):
    """
    The JSON object in the file at ``path``; None when the file is missing, unreadable, not JSON, or holds
    something other than an object::

        {"variant": "dual", "port": 8000, ...}
    """

    def command(self, path: str) -> StringCommand:
        return StringCommand("cat", QuoteString(path), "2>/dev/null || true")

    @staticmethod
    def default() -> None:
        return None

    def process(self, output: list[str]) -> dict | None:
        try:
            value = json.loads("\n".join(output))
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


class Sha256FileWithoutLines(FactBase):
    """
    The sha256 (hex) of the file at ``path`` with its lines starting with ``prefix`` left out, as read on the
    host (so a secret on such a line never reaches the controller). A missing file hashes as empty::

        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    """

    def command(self, path: str, prefix: str) -> StringCommand:
        return StringCommand(
            "grep", "-v", "--", QuoteString("^" + prefix), QuoteString(path), "2>/dev/null | sha256sum"
        )

    @staticmethod
    def default() -> None:
        return None

    def process(self, output: list[str]) -> str | None:
        return output[0].split(" ")[0] or None if output else None
