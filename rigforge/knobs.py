"""Small checks for host-data knobs, used by the roles' `validate(data) -> problems`.

Each returns a list of problems (empty when the value is fine); a problem names the host-data key, the bad
value and what is allowed. Pure functions: no pyinfra, no host.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from rigforge.render import setting_problems

URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~%/+:@=-]*)?$")
HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^[0-9a-fA-F:]+$")


def boolean(data: Mapping, key: str) -> list[str]:
    value = data.get(key)
    return [] if value in (True, False) else [f"{key} must be true or false, got {value!r}"]


def integer(data: Mapping, key: str, low: int, high: int, unit: str = "") -> list[str]:
    value = data.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, str) and value.isdigit()
    if ok and low <= int(value) <= high:
        return []
    return [f"{key} must be a whole number{unit} in {low}..{high}, got {value!r}"]


def choice(data: Mapping, key: str, allowed: tuple) -> list[str]:
    value = data.get(key)
    return [] if value in allowed else [f"{key} must be one of: {', '.join(map(str, allowed))}; got {value!r}"]


def url(data: Mapping, key: str, optional: bool = False) -> list[str]:
    value = data.get(key)
    if value is None and optional:
        return []
    if isinstance(value, str) and URL.fullmatch(value):
        return []
    return [f"{key} must be an http(s) URL without spaces or quotes, got {value!r}"]


def hostname(data: Mapping, key: str) -> list[str]:
    value = data.get(key)
    if isinstance(value, str) and HOSTNAME.fullmatch(value):
        return []
    return [f"{key} must be a host name or IP address, got {value!r}"]


def settings(data: Mapping, names: dict[str, str]) -> list[str]:
    """Problems of rendering settings ({setting name: host-data key}) set in `data` (None = not set)."""
    raw = {name: data.get(key) for name, key in names.items() if data.get(key) is not None}
    return setting_problems(raw, host_data=True)
