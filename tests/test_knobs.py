"""Each role's knobs (rigforge/knobs/): the commented DEFAULTS table becomes the role's frozen, typed settings."""

from __future__ import annotations

import dataclasses

import pytest

from rigforge.knobs import typed
from rigforge.knobs.docker_engine import DEFAULTS as DOCKER
from rigforge.knobs.docker_engine import DockerEngine
from rigforge.knobs.gateway import Gateway
from rigforge.knobs.nvidia_driver import DEFAULTS as DRIVER
from rigforge.knobs.nvidia_driver import NvidiaDriver
from rigforge.knobs.weights import Weights


def test_a_roles_settings_have_one_field_per_knob_typed_by_its_default():
    for cls, defaults in ((DockerEngine, DOCKER), (NvidiaDriver, DRIVER)):
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        assert list(fields) == list(defaults)
        assert all(fields[k] is type(v) for k, v in defaults.items() if v is not None)


def test_of_applies_the_defaults_and_the_settings_are_frozen():
    k = DockerEngine.of({"docker_source": "distro", "unrelated_key": 1})
    assert k.docker_source == "distro" and k.docker_repo_key_fingerprint == DOCKER["docker_repo_key_fingerprint"]
    assert not hasattr(k, "unrelated_key")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.docker_source = "docker"
    t = typed("T", {"port": 8000, "url": None})
    assert dataclasses.astuple(t.of({"url": "http://x"})) == (8000, "http://x")


def test_whole_numbers_given_as_digits_are_ints():
    from rigforge.knobs.serving import Serving

    assert Serving.of({"serving_health_timeout": "900"}).serving_health_timeout == 900
    assert Serving.of({}).serving_health_timeout == 600 and Serving.of({}).rigforge_manage_services is True


def test_secret_knobs_never_show_in_a_repr():
    shown = repr(Gateway.of({"gateway_api_key": "fleet-s3cret"})) + repr(Weights.of({"hf_token": "hf_s3cret"}))
    assert "s3cret" not in shown and "gateway_port=8088" in shown
