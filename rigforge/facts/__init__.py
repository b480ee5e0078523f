from pyinfra.api import FactBase


class Fact(FactBase):
    """A rigforge fact: no output (pyinfra's `default()`) means what its `process([])` makes of none."""

    def default(self):
        return self.process([])


def sections(lines, mark: str) -> dict[str, list[str]]:
    """{header: its lines} of output split at the lines starting with `mark` (header: the rest, stripped)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith(mark):
            current = out.setdefault(line[len(mark) :].strip(), [])
        elif current is not None:
            current.append(line)
    return out
