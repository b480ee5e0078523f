"""Where a rig gets its locked image (rigforge/observe/obtain.py), against a real CNCF Distribution registry (Debian's
docker-registry) on 127.0.0.1: the fleet's copy, upstream, neither; the one-line refusal; `rigforge lock`
resolving a tag upstream lost from the fleet's copy; the fill operation on pyinfra's @fake connector."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import requests
from registry_support import Registry, free_port, push_image, running_registry

from rigforge.cli import lock as locking
from rigforge.model import registry
from rigforge.model.knobs import registry as registry_knobs
from rigforge.model.pins import ImagePin, load_lock
from rigforge.observe import obtain

REF = "vllm/vllm-openai:v0.27.1"


@pytest.fixture
def distribution(tmp_path):
    """A plain-HTTP Distribution registry on 127.0.0.1 (a fresh one per test), its URL."""
    with running_registry(tmp_path / "registry") as reg:
        yield reg.url


def push(url: str, repository: str, tag: str) -> str:
    """Push a 2-layer schema2 image; its manifest digest."""
    return push_image(Registry(url, Path(), Path(), None), repository, tag, layers=2)["digest"]


def delete(url: str, repository: str, digest: str) -> None:
    requests.delete(f"{url}/v2/{repository}/manifests/{digest}", timeout=10).raise_for_status()


def fleet_at(url: str) -> registry.RegistryPlan:
    host, port = url.removeprefix("http://").split(":")
    return registry.build(
        "gw",
        {**registry_knobs.DEFAULTS, "registry_address": host, "registry_port": int(port), "registry_insecure": True},
    )


def test_references_are_read_as_docker_reads_them():
    assert obtain.parse("vllm/vllm-openai:v1@sha256:" + "a" * 64) == obtain.ImageRef(
        "docker.io", "vllm/vllm-openai", "v1", "sha256:" + "a" * 64
    )
    assert obtain.parse("ubuntu").repository == "library/ubuntu" and obtain.parse("ubuntu").tag is None
    assert obtain.parse("127.0.0.1:5000/x/y:t").registry == "127.0.0.1:5000"
    assert obtain.parse("ghcr.io/a/b:c").on_docker_hub is False
    assert obtain.parse("vllm/vllm-openai:v1@sha256:" + "a" * 64).pinned == "vllm/vllm-openai@sha256:" + "a" * 64
    with pytest.raises(ValueError):
        obtain.parse("x@sha256:abc")


def test_a_rig_gets_the_image_from_the_fleet_after_upstream_deleted_it(distribution):
    upstream = distribution  # one registry stands for both here: what differs is the name each is asked by
    digest = push(distribution, "vllm/vllm-openai", "v0.27.1")
    image = f"{REF}@{digest}"
    fleet = fleet_at(distribution)
    found = obtain.sources(image, fleet, upstream, None)
    assert [(s.kind, s.has) for s in found] == [("fleet", True), ("upstream", True)]
    assert obtain.problem(image, found, "vllm/dual") is None
    assert obtain.origin(True, found) == ("the fleet registry and upstream", False)

    delete(distribution, "vllm/vllm-openai", digest)  # gone everywhere
    found = obtain.sources(image, fleet, upstream, None)
    assert [(s.kind, s.has, s.detail) for s in found] == [("fleet", False, "HTTP 404"), ("upstream", False, "HTTP 404")]
    line = obtain.problem(image, found, "vllm/dual")
    assert line == (
        f"image {image} is in no source this rig can pull from (the fleet registry {fleet.endpoint}: HTTP 404; "
        "upstream (docker.io): HTTP 404), and the rig does not hold it: move to the recipe repo's live successor: "
        "rigforge_variant: vllm/dual, or `rigforge images load DIR` a saved copy onto the rig"
    )
    text, warn = obtain.origin(True, found)
    assert warn and text.startswith("this rig alone: no other copy exists")


def test_only_the_fleet_copy_left(distribution):
    digest = push(distribution, "vllm/vllm-openai", "v0.27.1")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: upstream unreachable
    found = obtain.sources(f"{REF}@{digest}", fleet_at(distribution), dead, None)
    assert [(s.kind, s.has) for s in found] == [("fleet", True), ("upstream", None)]
    assert found[1].detail.startswith("unreachable: ConnectionError")
    assert obtain.unasked("x", found) is None  # the fleet has it
    gone = obtain.sources(f"{REF}@sha256:{'c' * 64}", fleet_at(distribution), dead, None)
    assert [(s.kind, s.has) for s in gone] == [("fleet", False), ("upstream", None)]
    assert obtain.problem("x", gone, None) is None  # upstream could not be asked: not refused, but said
    assert obtain.unasked("x", gone).startswith("could not tell whether any source has image x (the fleet registry")
    # upstream could not be asked: not said to be gone
    assert obtain.origin(False, found) == (
        "the fleet registry (upstream (docker.io) could not be asked); not on the rig yet",
        False,
    )


def test_another_registrys_image_is_asked_of_the_fleet_under_that_registrys_host(distribution):
    digest = push(distribution, "a/b", "c")  # Docker Hub's a/b: not the copy of ghcr.io's a/b
    image = f"ghcr.io/a/b:c@{digest}"
    fleet = fleet_at(distribution)
    found = obtain.sources(image, fleet, None, None)
    assert [(s.kind, s.has) for s in found[:1]] == [("fleet", False)]
    assert push(distribution, "ghcr.io/a/b", "c") == digest  # where the fill puts ghcr.io's copy
    found = obtain.sources(image, fleet, None, None)
    assert [(s.name, s.has) for s in found[:1]] == [(f"the fleet registry {fleet.endpoint}", True)]
    assert found[1].name == "upstream (ghcr.io)"


def test_a_rig_pulls_another_registrys_image_by_the_fleets_copy_and_a_docker_hub_one_by_its_own_name():
    fleet = registry.build("gw", {**registry_knobs.DEFAULTS, "registry_address": "10.0.0.5"})
    digest = "sha256:" + "d" * 64
    ghcr = f"ghcr.io/ggml-org/llama.cpp:server-cuda-b10236@{digest}"
    assert obtain.pulled_as(ghcr, fleet) == f"10.0.0.5:5000/ghcr.io/ggml-org/llama.cpp:server-cuda-b10236@{digest}"
    assert obtain.pulled_as(ghcr, None) == ghcr  # no fleet registry: from ghcr.io itself
    assert obtain.pulled_as(f"{REF}@{digest}", fleet) == f"{REF}@{digest}"  # through the mirror, by its own name
    assert obtain.pulled_as("ghcr.io/ggml-org/llama.cpp:b1", fleet) == "ghcr.io/ggml-org/llama.cpp:b1"  # no digest
    assert obtain.fleet_repository(obtain.parse(ghcr)) == "ghcr.io/ggml-org/llama.cpp"
    assert obtain.fleet_repository(obtain.parse("ubuntu:24.04")) == "library/ubuntu"


def test_lock_resolves_a_ghcr_tag_upstream_lost_from_the_fleets_copy(distribution, tmp_path):
    ref = "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236"
    with running_registry(tmp_path / "upstream") as upstream:  # empty: upstream lost the tag
        digest = push(distribution, "ghcr.io/ggml-org/llama.cpp", "server-cuda-b10236")
        lock = load_lock(locking.default_lock_path())
        seed = dataclasses.replace(lock.image, digest="sha256:" + "e" * 64)  # resolved: not asked
        lock = dataclasses.replace(lock, image=seed, images={"llama-cpp-local": ImagePin(ref)}, git={}, hf={})
        new, report = locking.resolve(lock, [], None, None, upstream.url, fleet=(distribution, False))
        assert new.images["llama-cpp-local"].digest == digest
        assert (
            report[-1].startswith(f"images.llama-cpp-local: {ref} -> {digest}")
            and "from the fleet registry" in (report[-1])
        )


def test_lock_resolves_a_tag_upstream_lost_from_the_fleets_copy(distribution, tmp_path):
    with running_registry(tmp_path / "upstream") as upstream:  # a second, empty registry stands for upstream
        digest = push(distribution, "vllm/vllm-openai", "v0.27.1")
        lock = load_lock(locking.default_lock_path())
        lock = dataclasses.replace(lock, image=ImagePin(REF), images={}, git={}, hf={})
        with pytest.raises(locking.LockError, match="HTTP 404, it no longer has this tag"):
            locking.resolve(lock, [], None, None, upstream.url)
        new, report = locking.resolve(lock, [], None, None, upstream.url, fleet=(distribution, False))
        assert new.image.digest == digest and new.image.cuda == "13.0"
        assert report[0] == (
            f"image: {REF} -> {digest} (CUDA 13.0) (from the fleet registry {distribution}: upstream no longer has "
            "this tag)"
        )
        delete(distribution, "vllm/vllm-openai", digest)
        with pytest.raises(locking.LockError, match="the fleet registry .* has no copy either"):
            locking.resolve(lock, [], None, None, upstream.url, fleet=(distribution, False))


FILLS = {  # the locked image (its digest appended) -> (where skopeo reads it, where the fleet holds it)
    REF: ("docker://docker.io/vllm/vllm-openai", "vllm/vllm-openai:v0.27.1"),
    # another registry's image under that registry's host: rigs pull it by that name (obtain.pulled_as)
    "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236": (
        "docker://ghcr.io/ggml-org/llama.cpp",
        "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236",
    ),
}


@pytest.mark.parametrize("ref", sorted(FILLS))
def test_the_fill_copies_once_keeping_the_digest_and_skips_a_held_image(ref):
    from pyinfra.api import deploy
    from test_roles_host_ops import converge, executed, rig

    from rigforge.model.registry import RegistryPlan
    from rigforge.observe.facts.docker import RegistryHasImage
    from roles.operations.fleet_copy import image_in_fleet

    digest = "sha256:" + "b" * 64
    source, copy = FILLS[ref]

    @deploy("fill")
    def fill():
        image_in_fleet(
            name="fill", image=f"{ref}@{digest}", reg=RegistryPlan("gw", "127.0.2.1", 5000, False, Path("/ca"))
        )

    cmds = executed(converge({"gw": rig()}, fill), "gw")
    expected = f"skopeo copy --all --preserve-digests --retry-times 3 {source}@{digest} docker://127.0.2.1:5000/{copy}"
    assert expected in cmds
    held = rig()
    fact = RegistryHasImage().command("127.0.2.1:5000", copy.rsplit(":", 1)[0], digest).get_raw_value()
    held["fake_responses"] = {fact: ["yes"], **held["fake_responses"]}
    assert not any(c.startswith("skopeo copy") for c in executed(converge({"gw": held}, fill), "gw"))


def test_status_asks_the_registries_over_https_from_its_parallel_ssh_sessions(tmp_path, monkeypatch):
    """`rigforge status` reads rigs in gevent greenlets; its HTTPS requests to the registries work only because
    gevent patches ssl before anything imports it (rigforge/cli/main.py): a late patch made each one recurse."""
    import subprocess
    import sys

    ca_dir = tmp_path / "ca"
    crt, key = registry.server_certificate(ca_dir, "127.0.0.1")
    (tmp_path / "s.crt").write_text(crt)
    (tmp_path / "s.key").write_text(key)
    with running_registry(tmp_path / "reg", tls=(tmp_path / "s.crt", tmp_path / "s.key", ca_dir / "ca.crt")) as reg:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca_dir / "ca.crt"))  # for the push only
        lock = load_lock(locking.default_lock_path())
        ref = lock.image.ref  # the seed variants' image (dual-turbo's)
        digest = push_image(reg, "vllm/vllm-openai", ref.rsplit(":", 1)[1], layers=1)["digest"]
        monkeypatch.delenv("REQUESTS_CA_BUNDLE")
        lock_path = tmp_path / "lock.yaml"
        from rigforge.model.pins import dump_lock

        image = dataclasses.replace(lock.image, digest=digest)
        lock_path.write_text(dump_lock(dataclasses.replace(lock, image=image)))
        data = {
            "rigforge_variant": "dual-turbo",
            "rigforge_manage_services": True,
            "rigforge_lock": str(lock_path),
            "serving_image_upstream": reg.url,
            "serving_image_upstream_ca": str(ca_dir / "ca.crt"),
            "rigforge_root": "/opt/rigforge-absent",  # status only reads; roots under /tmp are refused
        }
        inventory = tmp_path / "inventory.py"
        inventory.write_text(f"rigs = [('@local', {data!r})]\n")
        res = subprocess.run(
            [sys.executable, "-m", "rigforge.cli", "status", str(inventory)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert "Error" not in res.stdout, res.stdout
    assert f"@local: image {ref}@{digest}: NOT on the rig; from upstream; not on the rig yet" in res.stdout, res.stdout
