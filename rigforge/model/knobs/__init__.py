"""Every role's knobs (host-data keys), one module per role of roles/: a frozen dataclass declaring each knob with
its type, default and a comment (the role's defaults/main.yml), `DEFAULTS` derived from its fields, and
`validate(data) -> problems`. `Knobs.of(data)` gives a role its settings, defaults applied. `RoleKnobs`
(rigforge/model/knobs/roles.py) bundles every role's, typed: what a rig's plan carries (`Plan.knobs`, built once from
its validated host data). No host here.
"""

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import Field, field
from typing import Any, Self


@dataclasses.dataclass(frozen=True)
class Knobs:
    """A role's knobs: subclasses declare one field per host-data key, typed, with its default."""

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Self:
        """The knobs host `data` sets, each other one at its default (a whole number given as digits, as pyinfra's
        `--data KEY=300` gives it and the checks accept, read as the int it is)."""
        defaults = defaults_of(cls)
        return cls(**{key: _as(default, data.get(key, default)) for key, default in defaults.items()})


def defaults_of(cls: type[Knobs]) -> dict[str, Any]:
    """{host-data key: default} of a knobs class, in declaration order: the role's DEFAULTS."""
    return {f.name: _default(f) for f in dataclasses.fields(cls)}


def _default(f: Field) -> Any:  # a knob's default is any JSON-like value
    """A field's default value (a fresh copy of a mutable one)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def knob(default: Any, secret: bool = False) -> Any:  # a dataclass field stands for the value
    """A knob's field with a mutable default (a dict or list: a fresh copy each time), or a secret's, whose value a
    repr leaves out."""
    if isinstance(default, dict | list):
        return field(default_factory=lambda: copy.deepcopy(default), repr=not secret)
    return field(default=default, repr=not secret)


def _as(default: Any, value: Any) -> Any:
    """A whole number given as digits (pyinfra's `--data KEY=300`, which the checks accept) as the int it is."""
    return int(value) if type(default) is int and isinstance(value, str) and value.isdigit() else value
