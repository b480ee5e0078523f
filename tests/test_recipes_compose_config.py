"""Recipe-repo slugs against a real `docker compose config` (Debian 13's compose v2, no engine) in a chroot.

For every selectable slug, inside the tools rootfs with a copy of the club-3090 reference at the rig's checkout
path: (1) the rig's serve dir (include wrapper + host override + .env) resolves to exactly what rigforge's own
interpolation wrote as effective-compose.yml (that file, run alone with its .env, gives the same JSON);
(2) compared with the upstream file resolved by compose with its own defaults, only host-specific things differ:
image (the lock's), restart, published port/bind, mount sources; every command argument, the entrypoint script,
every environment entry, mount targets, ipc, shm and the GPU reservation are the recipe's.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from support import render_variant
from test_recipes import REFERENCE

from rigforge.model import recipes
from rigforge.model.recipes import parse_repo
from rigforge.model.schema import Settings, apply_overrides
from rigforge.testbed import tools_rootfs

pytestmark = pytest.mark.testbed
ROOT = "/rigforge-recipes-check"
IMAGE = "vllm/vllm-openai:v0.27.1@sha256:" + "cd" * 32
HOST_SPECIFIC = {"image", "restart", "ports", "volumes"}


@pytest.fixture(scope="module")
def tools(testbed_dir):
    root = tools_rootfs(testbed_dir)
    work = root / ROOT.lstrip("/")
    shutil.rmtree(work, ignore_errors=True)
    (work / "src").mkdir(parents=True)
    shutil.copytree(REFERENCE, work / "src" / recipes.GIT_NAME, symlinks=True)  # a copy: the reference stays as is
    yield root
    shutil.rmtree(work, ignore_errors=True)


def config(root, directory: str, file: str = "") -> dict:
    f = f"-f {file} " if file else ""
    r = subprocess.run(
        ["chroot", str(root), "/bin/sh", "-c", f"cd {directory} && docker compose {f}config --format json"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def write(root, rel: str, files: dict[str, str]) -> str:
    d = root / ROOT.lstrip("/") / rel
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return f"{ROOT}/{rel}"


SLUGS = (
    sorted(s for s, r in parse_repo(REFERENCE).recipes.items() if not r.refused and not r.needs_opt_in)
    if REFERENCE
    else []
)


@pytest.mark.parametrize("slug", SLUGS)
def test_effective_compose_is_what_docker_compose_config_resolves(tools, slug):
    repo = parse_repo(REFERENCE)
    r = repo.recipe(slug)
    s = apply_overrides(
        Settings(), {"root": ROOT, "hf_token": "hf_" + "q" * 34, "port": 18080, "bind_address": "127.0.0.1"}
    )
    files = render_variant(recipes.of(repo, r, IMAGE), s)
    serve = write(tools, f"serve/{r.name}", {k: v for k, v in files.items() if k != recipes.EFFECTIVE_FILE})
    alone = write(
        tools, f"effective/{r.name}", {"docker-compose.yml": files[recipes.EFFECTIVE_FILE], ".env": files[".env"]}
    )
    rig = config(tools, serve)
    assert config(tools, alone) == rig  # our interpolation + merge == compose's, field for field

    ((name, svc),) = rig["services"].items()
    upstream = f"{ROOT}/src/{recipes.GIT_NAME}/{r.compose_path}"
    up = config(tools, "/", upstream)["services"][name]  # the recipe's file with its own defaults
    assert svc["image"] == IMAGE and svc["restart"] == "no"
    for key in set(up) | set(svc):
        if key not in HOST_SPECIFIC and key != "environment":
            assert svc.get(key) == up.get(key), (slug, key)
    # the weights are fetched before: the container gets no token (a recipe that declares the variable gets it
    # empty; the llama.cpp recipes declare none)
    no_token = {key: "" for key in ("HUGGING_FACE_HUB_TOKEN",) if key in up["environment"]}
    assert svc["environment"] == {**up["environment"], **no_token}
    assert [v["target"] for v in svc["volumes"]] == [v["target"] for v in up["volumes"]]
    assert [(v.get("read_only"), v["type"]) for v in svc["volumes"]] == [
        (v.get("read_only"), v["type"]) for v in up["volumes"]
    ]
    for v in svc["volumes"]:
        assert v["source"].startswith((f"{ROOT}/models", f"{ROOT}/cache/", f"{ROOT}/src/{recipes.GIT_NAME}/")), v
    ((port,), (up_port,)) = (svc["ports"], up["ports"])
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "18080", up_port["target"])
    assert up_port["published"] == str(r.port)  # the registry's default_port is the file's own default


def test_the_recipes_image_env_sets_the_image_for_docker_compose_config(tools):
    """An engine with `image_env: VLLM_IMAGE` (upstream's later profiles): the serve dir passes the lock's image
    through .env, no override image, and a real `docker compose config` runs that image."""
    import dataclasses

    repo = parse_repo(REFERENCE)
    r = dataclasses.replace(repo.recipe("vllm/dual"), image_env="VLLM_IMAGE")
    s = apply_overrides(Settings(), {"root": ROOT, "port": 18081, "bind_address": "127.0.0.1"})
    files = render_variant(recipes.of(repo, r, IMAGE), s)
    assert "image:" not in files[recipes.OVERRIDE_FILE]
    serve = write(tools, "serve/image-env", {k: v for k, v in files.items() if k != recipes.EFFECTIVE_FILE})
    svc = next(iter(config(tools, serve)["services"].values()))
    assert svc["image"] == IMAGE


def test_a_tp2_slug_on_four_cards_pins_cards_0_and_1_for_docker_compose_config(tools):
    """The host override's card pin (hardware.serving_env) merges into the recipe's list-form environment as a
    real `docker compose config` merges it: CUDA_VISIBLE_DEVICES=0,1 and CUDA_DEVICE_ORDER=PCI_BUS_ID, every other
    entry the recipe's; effective-compose.yml says the same."""
    repo = parse_repo(REFERENCE)
    r = repo.recipe("vllm/dual")
    s = apply_overrides(Settings(), {"root": ROOT, "port": 18082, "bind_address": "127.0.0.1"})
    files = render_variant(recipes.of(repo, r, IMAGE), s, 4)
    serve = write(tools, "serve/four-cards", {k: v for k, v in files.items() if k != recipes.EFFECTIVE_FILE})
    alone = write(
        tools, "effective/four-cards", {"docker-compose.yml": files[recipes.EFFECTIVE_FILE], ".env": files[".env"]}
    )
    rig = config(tools, serve)
    assert config(tools, alone) == rig
    svc = next(iter(rig["services"].values()))
    two_cards = render_variant(recipes.of(repo, r, IMAGE), s, 2)
    plain = write(tools, "serve/two-cards", {k: v for k, v in two_cards.items() if k != recipes.EFFECTIVE_FILE})
    two = next(iter(config(tools, plain)["services"].values()))
    assert svc["environment"] == {
        **two["environment"],
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    assert two["environment"]["CUDA_VISIBLE_DEVICES"] is None  # on 2 cards the recipe's bare pass-through, no value
