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
    """New text: `patch` merged into `current` (the user's keys kept), then every item of `extend`'s lists added to
    the list at that key when it is not there yet. None when `current` already has it all. ValueError unless
    `current` is a JSON object (or empty): a user's broken file is never overwritten."""
    blank = not (current and current.strip())
    existing = {} if blank else json.loads(current)
    if not isinstance(existing, dict):
        raise ValueError("top level is not a JSON object")
    merged = deep_merge(existing, patch)
    for key, items in (extend or {}).items():
        have = merged.get(key) if isinstance(merged.get(key), list) else []
        merged[key] = have + [item for item in items if item not in have]
    return None if merged == existing and not blank else json.dumps(merged, indent=2) + "\n"
