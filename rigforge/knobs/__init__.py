"""Every role's knobs (host-data keys), one module per role of roles/: `DEFAULTS`, the commented table, and
`validate(data) -> problems`; `typed` makes a role's frozen settings (`knobs.docker_source`). No host here.
"""

import copy
from collections.abc import Mapping
from dataclasses import Field, field, make_dataclass
from typing import Any

from rigforge.schema import SECRETS  # a knob named after one never shows its value in a repr (a plan, a traceback)


def typed(name: str, defaults: Mapping[str, Any]) -> type:
    """A frozen dataclass, one field per key of `defaults` typed by its value, and `of(data)`: defaults applied."""
    fields = [(key, Any if value is None else type(value), _field(key, value)) for key, value in defaults.items()]
    cls = make_dataclass(name, fields, frozen=True)
    cls.of = classmethod(lambda c, data: c(**{k: _as(v, data.get(k, v)) for k, v in defaults.items()}))
    return cls


def _field(key: str, value: Any) -> Field:
    """A knob's field: a fresh copy of its default each time; a secret's value left out of the repr."""
    return field(default_factory=lambda: copy.deepcopy(value), repr=not key.endswith(SECRETS))


def _as(default: Any, value: Any) -> Any:
    """A whole number given as digits (pyinfra's `--data KEY=300`, which the checks accept) as the int it is."""
    return int(value) if type(default) is int and isinstance(value, str) and value.isdigit() else value
