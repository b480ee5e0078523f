"""The one writer of /etc/docker/daemon.json: merge keys into the existing JSON, keep everything else."""

import json
import posixpath
from io import StringIO

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation
from pyinfra.facts.files import FileContents

from roles.operations.checks import fail_command
from roles.operations.shown import unchanged


def deep_merge(base: dict, patch: dict) -> dict:
    """A copy of `base` with `patch` merged in: nested dicts merge, other values from `patch` win."""
    merged = dict(base)
    for key, value in patch.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = deep_merge(merged[key], value) if both else value
    return merged


def merged_text(current: str | None, patch: dict, extend: dict | None = None) -> str | None:
    """New text (the user's keys kept), None when `current` already has it; ValueError unless a JSON object."""
    blank = not (current and current.strip())
    existing = {} if blank else json.loads(current)
    if not isinstance(existing, dict):
        raise ValueError("top level is not a JSON object")
    merged = deep_merge(existing, patch)
    for key, items in (extend or {}).items():
        have = merged.get(key) if isinstance(merged.get(key), list) else []
        merged[key] = have + [item for item in items if item not in have]
    return None if merged == existing and not blank else json.dumps(merged, indent=2) + "\n"


@operation()
def merge_json(path: str, patch: dict, extend: dict | None = None):
    """Merge ``patch`` into the JSON file ``path`` (mode 644, created if missing) atomically; bad JSON fails the host.

    + path: the JSON file, e.g. Docker's daemon.json
    + patch: keys to set (nested mappings are merged)
    + extend: ``{key: [items]}``: items added to the list at that key when missing, the list's others kept
    """
    lines = host.get_fact(FileContents, path=path)
    try:
        text = merged_text(None if lines is None else "\n".join(lines), patch, extend)
    except ValueError as error:
        yield fail_command(f"{path} on {host.name} is not valid JSON ({error}); fix or remove it, then re-run.")
        return
    if unchanged(text is None, f"{path} already has {sorted({*patch, *(extend or {})})}"):
        return
    temp = posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.rigforge-new")
    yield StringCommand("mkdir", "-p", QuoteString(posixpath.dirname(path)))
    yield FileUploadCommand(StringIO(text), temp, remote_temp_filename=host.get_temp_filename(temp))
    yield StringCommand("chmod", "644", QuoteString(temp))
    yield StringCommand("mv", "-f", QuoteString(temp), QuoteString(path))
