from collections.abc import Iterable
from typing import TypeVar

from pyinfra.api import FactBase

T = TypeVar("T")


class Fact(FactBase[T]):
    """A rigforge fact: no output (pyinfra's `default()`) means what its `process([])` makes of none. `T`: the shape
    its `process` returns, as in pyinfra's own facts (``FactBase[dict[str, bool]]``)."""

    def default(self) -> T:
        return self.process([])


def sections(lines: Iterable[str], mark: str) -> dict[str, list[str]]:
    """{header: its lines} of output split at the lines starting with `mark` (header: the rest, stripped)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith(mark):
            current = out.setdefault(line[len(mark) :].strip(), [])
        elif current is not None:
            current.append(line)
    return out
