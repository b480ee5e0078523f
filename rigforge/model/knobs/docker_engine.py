import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rigforge.layout import NVIDIA_RUNTIME
from rigforge.model import schema
from rigforge.model.jsonmerge import deep_merge
from rigforge.model.knobs import Knobs, defaults_of, knob
from rigforge.model.pins import TOOLKIT_REPO_URL


@dataclass(frozen=True)
class DockerEngine(Knobs):
    """Docker, its compose plugin and the NVIDIA Container Toolkit (roles/docker_engine.py)."""

    docker_source: str = "docker"  # docker (Docker's apt repo) or distro (docker.io + compose v2 from the OS)
    docker_repo_url: str | None = None  # default https://download.docker.com/linux/<ubuntu|debian>
    docker_repo_key_url: str | None = None  # default <docker repo url>/gpg
    docker_repo_key_sha256: str | None = None  # pin the key file's sha256
    # a key with another fingerprint is refused; Docker's install docs: "Verify that you now have the key with the
    # fingerprint 9DC8 5822 9FC7 DD38 854A  E2D8 8D81 803C 0EBF CD88"
    docker_repo_key_fingerprint: str = "9DC858229FC7DD38854AE2D88D81803C0EBFCD88"
    # {package: version} pins, e.g. {"docker-ce": "5:28.5.1-1~ubuntu.24.04~noble"}
    docker_package_versions: dict[str, str] = knob({})
    docker_daemon_options: dict[str, Any] = knob({})  # extra daemon.json keys, merged in beside the nvidia runtime
    nvidia_toolkit_repo_url: str = TOOLKIT_REPO_URL  # NVIDIA's flat repo
    nvidia_toolkit_repo_key_url: str = "https://nvidia.github.io/libnvidia-container/gpgkey"  # armored key
    nvidia_toolkit_repo_key_sha256: str | None = None  # pin the key file's sha256
    nvidia_toolkit_repo_key_fingerprint: str | None = None  # check the toolkit key's fingerprint (40 hex digits)
    nvidia_toolkit_version: str | None = None  # pin and hold the four toolkit packages at this version, not the lock's


DEFAULTS = defaults_of(DockerEngine)
PACKAGE_VERSION = re.compile(r"[^ ]+", re.S)  # a Debian package version: no space in it


DOCKER_CE_PACKAGES = ["docker-ce", "docker-ce-cli", "containerd.io", "docker-buildx-plugin", "docker-compose-plugin"]


def daemon_json_patch(knobs: DockerEngine) -> dict:
    """The keys the docker_engine role merges into daemon.json: docker_daemon_options, then the nvidia runtime."""
    return deep_merge(knobs.docker_daemon_options or {}, NVIDIA_RUNTIME)


def validate(data: Mapping) -> list[str]:
    problems = schema.choice(data, "docker_source", ("docker", "distro"), deploy=True)
    versions = data["docker_package_versions"]
    if not isinstance(versions, Mapping) or not set(versions) <= set(DOCKER_CE_PACKAGES):
        problems.append(
            f"docker_package_versions={versions!r} must map some of {', '.join(DOCKER_CE_PACKAGES)} to versions."
        )
    problems += schema.matches(
        data,
        "nvidia_toolkit_version",
        PACKAGE_VERSION,
        what="a package version such as 1.18.0-1, or unset",
        optional=True,
        deploy=True,
    )
    for key in ("docker_repo_key_fingerprint", "nvidia_toolkit_repo_key_fingerprint"):
        problems += schema.matches(
            data, key, schema.FINGERPRINT, what="a 40-hex-digit key fingerprint, or unset", optional=True, deploy=True
        )
    return problems + data_root_problems(data)


def data_root_problems(data: Mapping) -> list[str]:
    """docker_daemon_options' data-root: a directory of its own (schema.docker_data_root), neither inside nor
    holding rigforge_root or serving_model_dir (those checked themselves by rigforge/model/schema.py)."""
    options = data.get("docker_daemon_options")
    if options is None:
        return []
    if not isinstance(options, Mapping):
        example = "{'log-level': 'warn'}"
        return [f"docker_daemon_options={options!r} must be a mapping of daemon.json keys, e.g. {example}."]
    if "data-root" not in options:
        return []
    try:
        data_root = schema.docker_data_root(options["data-root"])
    except ValueError as error:
        return [f"docker_daemon_options data-root={options['data-root']!r} must be {error}."]
    problems = []
    root = _valid_dir(data.get("rigforge_root"))
    for key in ("rigforge_root", "serving_model_dir"):
        path = _valid_dir(data.get(key))
        if not path or key == "serving_model_dir" and root and schema.inside(path, root):
            continue  # unset, refused by its own check, or named with the root
        if how := "holds" if schema.inside(path, data_root) else "is inside" if schema.inside(data_root, path) else "":
            problems.append(
                f"docker_daemon_options data-root={data_root!r} {how} {key} {path}: Docker's data-root and rigforge's "
                f"dirs never share a tree; choose a data-root apart from it (e.g. {schema.DOCKER_DATA_ROOT})."
            )
    return problems


def _valid_dir(value: object) -> str | None:
    """The rigforge dir `value` as schema parses it; None when unset or refused (its own check names it)."""
    try:
        return schema.SETTINGS["root"](value) if value is not None else None
    except ValueError:
        return None
