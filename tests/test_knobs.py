"""Each role's knobs (rigforge/model/knobs/): the commented DEFAULTS table becomes the role's frozen, typed settings."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import types
import typing

import pytest

import rigforge.model.knobs
from rigforge.model.knobs import Knobs, defaults_of
from rigforge.model.knobs.docker_engine import DEFAULTS as DOCKER
from rigforge.model.knobs.docker_engine import DockerEngine
from rigforge.model.knobs.gateway import Gateway
from rigforge.model.knobs.nvidia_driver import DEFAULTS as DRIVER
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.model.knobs.serving import DEFAULTS as SERVING
from rigforge.model.knobs.serving import Serving
from rigforge.model.knobs.weights import DEFAULTS as WEIGHTS
from rigforge.model.knobs.weights import Weights


def runtime_types(hint: object) -> tuple[type, ...]:
    """The classes a value of type `hint` may be an instance of (`str | None`: str, NoneType; dict[str, str]: dict)."""
    if isinstance(hint, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in runtime_types(arg))
    return (typing.get_origin(hint) or hint,)


def test_a_roles_knobs_are_declared_fields_and_each_default_is_of_its_type():
    """The knobs classes are declared (issue 48: a type checker sees their fields); DEFAULTS is derived from them."""
    for cls, defaults in ((DockerEngine, DOCKER), (NvidiaDriver, DRIVER), (Weights, WEIGHTS), (Serving, SERVING)):
        hints = typing.get_type_hints(cls)
        assert list(hints) == list(defaults) == [f.name for f in dataclasses.fields(cls)], cls
        for key, value in defaults.items():
            assert isinstance(value, runtime_types(hints[key])), (cls, key, value, hints[key])


def test_every_knob_module_declares_its_knobs_class():
    """Issue 48: no knob module is left a plain DEFAULTS dict; each declares one frozen Knobs class, typed, and its
    DEFAULTS are that class's fields."""
    names = [
        info.name for info in pkgutil.iter_modules(rigforge.model.knobs.__path__) if info.name != "roles"
    ]  # the bundle
    assert len(names) >= 10, names
    for name in names:
        module = importlib.import_module(f"rigforge.model.knobs.{name}")
        (cls,) = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Knobs) and v is not Knobs]
        assert cls.__module__ == module.__name__ and cls.__dataclass_params__.frozen, name
        assert module.DEFAULTS == defaults_of(cls), name
        hints = typing.get_type_hints(cls)
        for key, value in module.DEFAULTS.items():
            assert isinstance(value, runtime_types(hints[key])), (cls, key, value, hints[key])


def test_of_applies_the_defaults_and_the_settings_are_frozen():
    k = DockerEngine.of({"docker_source": "distro", "unrelated_key": 1})
    assert k.docker_source == "distro" and k.docker_repo_key_fingerprint == DOCKER["docker_repo_key_fingerprint"]
    assert not hasattr(k, "unrelated_key")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.docker_source = "docker"


def test_whole_numbers_given_as_digits_are_ints():
    assert Serving.of({"serving_health_timeout": "900"}).serving_health_timeout == 900
    assert Serving.of({}).serving_health_timeout == 600 and Serving.of({}).rigforge_manage_services is True


def test_secret_knobs_never_show_in_a_repr():
    shown = repr(Gateway.of({"gateway_api_key": "fleet-s3cret"})) + repr(Weights.of({"hf_token": "hf_s3cret"}))
    assert "s3cret" not in shown and "gateway_port=8088" in shown
