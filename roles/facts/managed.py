"""Facts about the files rigforge manages, as `status` and `verify` compare them with what the plan renders."""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase


class ContentHash(FactBase):
    """
    sha256 of a file without the lines that start with ``drop`` (all of it when ``drop`` is None), or None when
    the file does not exist:

    .. code:: python

        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    """

    def command(self, path: str, drop: str | None = None):
        keep = f"grep -v -- {shlex.quote('^' + drop)} {shlex.quote(path)}" if drop else f"cat {shlex.quote(path)}"
        return f"if [ -f {shlex.quote(path)} ]; then {keep} | sha256sum; else echo absent; fi"

    def process(self, output):
        first = (output[0] if output else "").split()
        return None if not first or first[0] == "absent" else first[0]


class JsonFile(FactBase):
    """
    A JSON file's content (rigforge's manifest, Docker's daemon.json), or None when it is missing, unreadable or
    not a JSON object:

    .. code:: python

        {"variant": "dual-turbo", "unit": "rigforge-vllm@dual-turbo.service", "port": 8011, ...}
    """

    def command(self, path: str):
        return f"cat {shlex.quote(path)} 2>/dev/null || true"

    def process(self, output):
        try:
            data = json.loads("\n".join(output))
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def default(self):
        return None


class DebInstalledVersion(FactBase):
    """
    The version of an installed Debian package, or None when it is not installed (removed, config files only,
    unknown):

    .. code:: python

        "580.95.05-1"
    """

    def requires_command(self, package: str) -> str:
        return "dpkg-query"

    def command(self, package: str):
        return f"dpkg-query -W -f '${{db:Status-Status}} ${{Version}}\\n' {shlex.quote(package)} 2>/dev/null || true"

    def process(self, output):
        words = (output[0] if output else "").split()
        return words[1] if len(words) > 1 and words[0] == "installed" else None

    def default(self):
        return None


class UnitActive(FactBase):
    """
    A systemd unit's active state as `systemctl is-active` prints it ("active", "inactive", "failed", ...), or
    "unknown" when systemd does not answer (a chroot):

    .. code:: python

        "active"
    """

    def command(self, unit: str):
        return f"systemctl is-active {shlex.quote(unit)} 2>/dev/null || true"

    def process(self, output):
        return (output[0].strip() if output else "") or "unknown"

    def default(self):
        return "unknown"
