"""Facts for verified weights: the stamp and the stat of every file in a model dir, and a venv's installed version."""

import shlex

from pyinfra.api import FactBase

from rigforge.layout import STAMP
from rigforge.observe.facts.files import json_object


def _ns(text: str) -> int:
    """GNU find's %T@ ('1732912345.1234567890') as integer nanoseconds, exactly."""
    sec, _, frac = text.partition(".")
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])


class WeightsState(FactBase[dict]):
    """fetch_weights.py's stamp and a stat of every file under ``dest`` and ``staging`` (never read): ``{"stamp": {...}
    or None, "files": {relpath: [size, mtime_ns]}, "staging": {relpath: size}, "staging_dir": whether it exists}``."""

    def command(self, dest: str, staging: str) -> str:
        d, s = shlex.quote(dest), shlex.quote(staging)
        return (
            f"cat {d}/{STAMP} 2>/dev/null | tr -d '\\n'; echo; echo '--files--'; "
            f"[ -d {d} ] && find {d} -type f ! -name '{STAMP}' -printf '%s %T@ %P\\n'; "
            f"echo '--staging--'; [ -d {s} ] && echo '--staging-dir--' && find {s} -type f -printf '%s %P\\n'; true"
        )

    @staticmethod
    def default() -> dict:
        return {"stamp": None, "files": {}, "staging": {}, "staging_dir": False}

    def process(self, output: list[str]) -> dict:
        state = self.default()
        section = "stamp"
        for line in output:
            if line == "--staging-dir--":
                state["staging_dir"] = True
            elif line in ("--files--", "--staging--"):
                section = line.strip("-")
            elif section == "stamp" and line.strip():
                state["stamp"] = json_object(line)
            elif section == "files" and line.strip():
                size, mtime, path = line.split(" ", 2)
                state["files"][path] = [int(size), _ns(mtime)]
            elif section == "staging" and line.strip():
                size, path = line.split(" ", 1)
                state["staging"][path] = int(size)
        return state


class VenvDistVersion(FactBase[str | None]):
    """Version of ``dist`` installed in the venv ``venv``, from its ``.dist-info`` name (no pip: ~1 s), or None."""

    def command(self, venv: str, dist: str) -> str:
        q = shlex.quote
        return f"ls -d {q(venv)}/lib/python3*/site-packages/{q(dist)}-*.dist-info 2>/dev/null || true"

    def process(self, output: list[str]) -> str | None:
        for line in output:
            name = line.strip().rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".dist-info"):
                return name[: -len(".dist-info")].split("-", 1)[1]
        return None


class FileDigests(FactBase[dict[str, str]]):
    """{path: sha256 hex} of each readable one of ``paths`` under ``dest``, hashed on the host (weights_deep_verify)."""

    probe = False  # never part of the batched probe: it reads gigabytes, only when asked to

    def command(self, dest: str, paths: list[str]) -> str:
        names = " ".join(shlex.quote(p) for p in paths)
        return f"cd {shlex.quote(dest)} 2>/dev/null && sha256sum -- {names} 2>/dev/null; true"

    default = dict

    def process(self, output: list[str]) -> dict[str, str]:
        lines = (line.partition("  ") for line in output)
        return {path: digest for digest, _, path in lines if len(digest) == 64 and path}
