"""Every role's knobs (host-data keys), one module per role of roles/: a frozen dataclass declaring each knob with
its type, default and a comment (the role's defaults/main.yml), `DEFAULTS` derived from its fields, and
`validate(data) -> problems`. `Knobs.of(data)` gives a role its settings, defaults applied. `RoleKnobs` bundles
every role's, typed: what a rig's plan carries (`Plan.knobs`, built once from its validated host data). No host here.

`typed` builds such a class from a DEFAULTS dict at run time; no knob module uses it any more, only
tests/test_knobs.py does: it goes once that test stops calling it.
"""

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import Field, field, make_dataclass
from typing import TYPE_CHECKING, Any, Self

from rigforge.schema import SECRETS  # a knob named after one never shows its value in a repr (a plan, a traceback)

if TYPE_CHECKING:  # each of these modules imports this one (Knobs)
    from rigforge.knobs.docker_engine import DockerEngine
    from rigforge.knobs.gateway import Gateway
    from rigforge.knobs.gpu_power import GpuPower
    from rigforge.knobs.monitor import Monitor
    from rigforge.knobs.nvidia_driver import NvidiaDriver
    from rigforge.knobs.registry import Registry
    from rigforge.knobs.serving import Serving
    from rigforge.knobs.site import Site
    from rigforge.knobs.weights import Weights


@dataclasses.dataclass(frozen=True)
class Knobs:
    """A role's knobs: subclasses declare one field per host-data key, typed, with its default."""

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Self:
        """The knobs host `data` sets, each other one at its default (a whole number given as digits, as pyinfra's
        `--data KEY=300` gives it and the checks accept, read as the int it is)."""
        defaults = defaults_of(cls)
        return cls(**{key: _as(default, data.get(key, default)) for key, default in defaults.items()})


@dataclasses.dataclass(frozen=True)
class RoleKnobs:
    """Every role's knobs of one host, typed, each at its default unless host data sets it: what a rig's plan carries
    (`Plan.knobs`), built once from the host data the plan was checked against (rigforge/fleet.py build_plan). A role
    reads `plan.knobs.serving.rigforge_manage_services`, never a host-data key."""

    site: "Site"  # the deploy's own (roles/site.py): which variant, which lock
    driver: "NvidiaDriver"  # the NVIDIA driver and the apt state around it (roles/nvidia_driver.py)
    docker: "DockerEngine"  # Docker and the NVIDIA Container Toolkit (roles/docker_engine.py)
    gpu_power: "GpuPower"  # the GPUs' power caps (roles/gpu_power.py)
    weights: "Weights"  # the weights download (roles/weights.py)
    serving: "Serving"  # how the vLLM unit is run and gated (roles/serving.py)
    gateway: "Gateway"  # the fleet's gateway: on a rig, the address it is reached on and its drain timeout
    registry: "Registry"  # the fleet registry (roles/registry.py)
    monitor: "Monitor"  # the monitor host's Prometheus; on a rig, its node exporter's port

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Self:
        """Every role's knobs host `data` sets, each other one at its default (`Knobs.of`)."""
        # imported here: each of them imports this module
        from rigforge.knobs import docker_engine, gateway, gpu_power, monitor, nvidia_driver, registry, serving
        from rigforge.knobs import site as site_knobs
        from rigforge.knobs import weights as weights_knobs

        return cls(
            site=site_knobs.Site.of(data),
            driver=nvidia_driver.NvidiaDriver.of(data),
            docker=docker_engine.DockerEngine.of(data),
            gpu_power=gpu_power.GpuPower.of(data),
            weights=weights_knobs.Weights.of(data),
            serving=serving.Serving.of(data),
            gateway=gateway.Gateway.of(data),
            registry=registry.Registry.of(data),
            monitor=monitor.Monitor.of(data),
        )


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
