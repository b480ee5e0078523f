"""JSON objects merged key by key: the one way rigforge writes a file it shares with the user (daemon.json)."""

import json


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
