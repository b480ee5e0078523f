"""The settings schema: every setting a rig's files depend on, its parser and host-data key (layering: the variant's
values < group data < host data < `--set`), and the checks of the roles' own knobs. Pure: no pyinfra, no host.
"""

import contextlib
import ipaddress
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import yaml

from rigforge.layout import DEFAULT_ROOT, ETC

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e5m2", "fp8_e4m3", "turboquant_3bit_nc")
URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~%/+:@=-]*)?$")
HTTP_URL = re.compile(r"https?://[^ ]*")  # what clients or people are shown: no space in it
NOT_BLANK = re.compile(r"\s*\S.*", re.S)  # a path on the controller: anything but blank
FINGERPRINT = re.compile(r"( *[^ ]){40} *", re.S)  # an OpenPGP key's: 40 characters once spaces are removed
HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^[0-9a-fA-F:]+$")
SETTLE_WINDOW_S = 60  # default of host data gpu_power_settle_window_s: how long the settle stage watches after boot


class SettingsError(ValueError):
    """A setting has an unknown name or a value of the wrong type or range."""


def _int(v: Any) -> int:
    if isinstance(v, bool) or not re.fullmatch(r"-?\d+", str(v).strip()):
        raise ValueError("an integer")
    return int(v)


def _int_in(low: int, high: int, what: str = "an integer") -> Callable[[Any], int]:
    """A parser of whole numbers in low..high (ValueError naming `what` and the range otherwise)."""

    def check(v: Any) -> int:
        with contextlib.suppress(ValueError):
            if low <= (n := _int(v)) <= high:
                return n
        raise ValueError(f"{what} in {low}..{high}")

    return check


def _fraction(v: Any) -> float:
    with contextlib.suppress(TypeError, ValueError):
        if 0 < (f := float(v)) <= 1:
            return f
    raise ValueError("a number in (0, 1]")


def _ip(v: Any) -> str:
    try:
        return str(ipaddress.ip_address(str(v)))
    except ValueError:
        raise ValueError("an IP address such as 127.0.0.1 or 0.0.0.0") from None


SAFE_PATH = re.compile(r"^/[A-Za-z0-9._+@/-]*$")


# The system's own directories: a rigforge dir may live below them (/home/ai/rigforge), never be one of them.
SYSTEM_DIRS = {
    "/",
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/media",
    "/mnt",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/srv",
    "/sys",
    "/tmp",
    "/usr",
    "/usr/bin",
    "/usr/lib",
    "/usr/local",
    "/usr/sbin",
    "/usr/share",
    "/var",
    "/var/cache",
    "/var/lib",
    "/var/log",
    "/var/tmp",
}
DOCKER_DATA_ROOT = "/var/lib/docker"  # Docker's data-root unless daemon.json sets another (checked in preflight)
# Trees something else manages (a rigforge dir is neither one of them nor anywhere below): tree -> who and why.
MANAGED_TREES = {
    "/proc": "the kernel's process file system",
    "/sys": "the kernel's sysfs",
    "/dev": "the kernel's device files",
    "/run": "a tmpfs emptied at every boot",
    "/tmp": "cleared at boot or by systemd-tmpfiles",
    "/var/tmp": "cleaned by systemd-tmpfiles",
    "/boot": "the kernels and boot loader, often a small partition of its own",
    ETC: "rigforge's own config dir (rig.json, the gateway)",
    "/etc/systemd": "systemd's config",
    "/lib/systemd": "systemd's own files",
    "/usr/lib/systemd": "systemd's own files",
    "/var/lib/systemd": "systemd's state",
    # package managers' state: their databases, lists and caches
    "/var/lib/dpkg": "dpkg's package database",
    "/var/lib/apt": "apt's package lists and state",
    "/var/cache/apt": "apt's package cache (apt-get clean empties it)",
    "/var/cache/debconf": "debconf's answers",
    "/var/lib/aptitude": "aptitude's state",
    "/var/lib/rpm": "rpm's package database",
    "/var/lib/dnf": "dnf's state",
    "/var/cache/dnf": "dnf's package cache",
    "/var/lib/snapd": "snapd's state",
    "/snap": "snapd's mounted snaps",
    "/var/snap": "the snaps' own data",
    "/var/lib/flatpak": "Flatpak's installations",
    # container runtimes' state: their images, containers and volumes
    DOCKER_DATA_ROOT: "Docker's default data-root",
    "/var/lib/containerd": "containerd's images and containers",
    "/var/lib/containers": "Podman's and CRI-O's images and containers",
    "/var/lib/lxc": "LXC's containers",
    "/var/lib/lxd": "LXD's containers",
    "/var/lib/incus": "Incus's containers",
    "/var/lib/kubelet": "the kubelet's pods and volumes",
}


HOMES = {"/home", "/mnt", "/media", "/opt", "/srv", "/usr/local", "/var/lib"}  # a rigforge dir below them is sane


def managed_tree(path: str, trees: dict[str, str] = MANAGED_TREES) -> str | None:
    """'<tree>, <who>' when `path` is one of `trees` or below one, else None."""
    return next((f"{tree}, {who}" for tree, who in trees.items() if inside(path, tree)), None)


def inside(path: str, tree: str) -> bool:
    """True when `path` is `tree` or below it."""
    return path == tree or path.startswith(f"{tree.rstrip('/')}/")


ROOT_EXAMPLES = (DEFAULT_ROOT, "/srv/rigforge", "/home/rigforge")  # offered in this order; none is refused alone


def example_root(*avoid: str) -> str:
    """A rigforge dir to offer in a refusal: the first of ROOT_EXAMPLES neither inside nor holding any of `avoid`
    (only '/' holds them all)."""
    fits = (root for root in ROOT_EXAMPLES if not any(inside(root, t) or inside(t, root) for t in avoid))
    return next(fits, "a directory of its own such as /data/rigforge")


def _safe_path(v: Any) -> str:
    """An absolute path safe in a shell, compose file, unit and daemon.json, without its trailing '/'."""
    s = str(v) if isinstance(v, str) else ""
    if not SAFE_PATH.fullmatch(s) or "/../" in f"{s}/" or "//" in s:
        raise ValueError(
            "an absolute path of letters, digits and . _ + @ - / (no spaces, quotes, ':' or shell characters)"
        )
    return s.rstrip("/") or "/"


def _abs_path(v: Any) -> str:
    """An absolute path safe in a shell, compose file and unit, below the system's dirs, outside managed trees."""
    path = _safe_path(v)
    if tree := managed_tree(path):
        raise ValueError(f"a directory of its own outside {tree} (e.g. {DEFAULT_ROOT})")
    if path in SYSTEM_DIRS:
        example = f"{path}/rigforge" if path in HOMES else DEFAULT_ROOT
        raise ValueError(f"a directory of its own, not the system directory {path} (e.g. {example})")
    return path


def docker_data_root(v: Any) -> str:
    """A Docker data-root rigforge may write into daemon.json: a safe absolute path, Docker's default or a directory
    of its own outside the system's dirs and every other tree something else manages."""
    path = _safe_path(v)
    others = {tree: who for tree, who in MANAGED_TREES.items() if tree != DOCKER_DATA_ROOT}
    if path != DOCKER_DATA_ROOT and (tree := managed_tree(path, {DOCKER_DATA_ROOT: MANAGED_TREES[DOCKER_DATA_ROOT]})):
        raise ValueError(f"{DOCKER_DATA_ROOT} itself or a directory outside it, not below {tree}")
    if tree := managed_tree(path, others):
        raise ValueError(f"a directory of its own outside {tree} (e.g. {DOCKER_DATA_ROOT}, Docker's default)")
    if path in SYSTEM_DIRS:
        raise ValueError(f"a directory of its own, not the system directory {path} (e.g. {DOCKER_DATA_ROOT})")
    return path


def data_root_overlap(key: str, path: str, data_root: str, where: str) -> str | None:
    """The refusal when the rigforge dir `key` (at `path`) and Docker's data-root (`where`) lie one inside the
    other, else None: Docker's images and rigforge's trees never share one."""
    example = example_root(data_root)
    if inside(path, data_root):
        return f"{key} {path} is inside {data_root}, {where}; choose a directory of its own outside it (e.g. {example})"
    if inside(data_root, path):
        return (
            f"{key} {path} holds {data_root}, {where}; Docker's data-root and rigforge's dir never share a tree: "
            f"choose a {key} that does not hold it (e.g. {example})"
        )
    return None


def _choice(*allowed: str) -> Callable[[Any], str]:
    """A parser of one of `allowed` (ValueError listing them otherwise)."""

    def check(v: Any) -> str:
        if str(v) not in allowed:
            raise ValueError(f"one of: {', '.join(allowed)}")
        return str(v)

    return check


def _args(v: Any) -> tuple[str, ...]:
    """A list of vLLM arguments; a string is a YAML list when it is one ("[--a, --b]"), else split on spaces."""
    with contextlib.suppress(yaml.YAMLError):
        items = yaml.safe_load(v) if isinstance(v, str) and v.strip().startswith("[") else v
        items = items if isinstance(items, list | tuple) else str(items).split()
        if all(isinstance(x, str) and x and "\n" not in x for x in items):
            return tuple(items)
    raise ValueError("a list of vLLM arguments such as ['--enable-log-requests']")


IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")


def _image(v: Any) -> str:
    if not (isinstance(v, str) and IMAGE.fullmatch(v) and len(v) <= 512):
        raise ValueError("an image reference such as vllm/vllm-openai:TAG[@sha256:DIGEST] (no quotes or spaces)")
    return str(v)


def _secret(v: Any) -> str:
    s = str(v) if isinstance(v, str | int) and not isinstance(v, bool) else ""
    if not re.fullmatch(r"[A-Za-z0-9._~+/=-]+", s):
        raise ValueError("a single word of letters, digits and . _ ~ + / = - (no spaces or quotes)")
    return s


WATTS = (100, 600)  # any card's power cap lies in here; the card's own min..max is checked once the driver answers
_watts = _int_in(*WATTS, "whole watts")
MAX_GPUS = 16


def _count(v: Any) -> int:
    n = _int(v)
    if n < 0:
        raise ValueError("a non-negative integer")
    return n


def _per_gpu_watts(v: Any) -> tuple[tuple[int, int], ...]:
    if isinstance(v, str):
        with contextlib.suppress(yaml.YAMLError):
            v = yaml.safe_load(v or "{}")
    if not isinstance(v, dict):
        raise ValueError("a mapping of GPU index to watts, e.g. {0: 230, 1: 250}")
    try:
        return tuple(sorted((_int_in(0, MAX_GPUS - 1)(k), _watts(w)) for k, w in v.items()))
    except ValueError:
        raise ValueError(
            f"a mapping of GPU index (0..{MAX_GPUS - 1}) to whole watts in {WATTS[0]}..{WATTS[1]}, "
            "e.g. {0: 230, 1: 250}"
        ) from None


def _setting(parse: Callable[[Any], Any], default: Any = None, host_key: str | None = None, **kwargs: Any) -> Any:
    """A Settings field: its default, its parser and its host-data key (None: serving_NAME) in the metadata."""
    return field(default=default, metadata={"parse": parse, "host_key": host_key}, **kwargs)


@dataclass(frozen=True)
class Settings:
    """Everything a rig's rendered files depend on besides the variant. None = the variant's value."""

    # each with its parser and host-data key (default serving_NAME); `rigforge render --set NAME=VALUE` names it
    port: int | None = _setting(_int_in(1, 65535, "a port number"))
    bind_address: str | None = _setting(_ip)
    model_dir: str | None = _setting(_abs_path)
    gpu_memory_utilization: float | None = _setting(_fraction)
    kv_cache_dtype: str | None = _setting(_choice(*KV_CACHE_DTYPES))
    max_model_len: int | None = _setting(_int_in(1, 1_048_576))
    max_num_seqs: int | None = _setting(_int_in(1, 1024))
    extra_args: tuple[str, ...] = _setting(_args, ())
    spec_n: int | None = _setting(_count)  # recipe-repo slugs only: the recipe's SPEC_N (0 = drafter off, vllm#50021)
    # recipe-repo slugs only: the recipe's NVLINK_MODE
    nvlink_mode: str | None = _setting(_choice("auto", "force_on", "force_off", "pcie_p2p"))
    image: str | None = _setting(_image)
    root: str = _setting(_abs_path, default=DEFAULT_ROOT, host_key="rigforge_root")
    power_limit_w: int = _setting(_watts, default=230, host_key="gpu_power_limit_w")
    power_limits: tuple[tuple[int, int], ...] = _setting(_per_gpu_watts, default=(), host_key="gpu_power_limits")
    # rigforge/observe/boot.py: how long the settle stage watches after boot
    settle_window_s: int = _setting(
        _int_in(0, 3600, "a whole number of seconds"), default=SETTLE_WINDOW_S, host_key="gpu_power_settle_window_s"
    )
    api_key: str | None = _setting(_secret, repr=False)
    hf_token: str | None = _setting(_secret, host_key="hf_token", repr=False)


SETTINGS = {f.name: f.metadata["parse"] for f in fields(Settings)}  # name -> parser
SECRETS = ("api_key", "hf_token")
HOST_KEYS = {f.name: f.metadata["host_key"] or f"serving_{f.name}" for f in fields(Settings)}  # setting -> its key


def _problem(name: str, value: Any, shown_as: str) -> list[str]:
    """[] when `value` parses as setting `name`; else the problem, naming it `shown_as` (a secret's value hidden)."""
    if name not in SETTINGS:
        return [f"unknown setting {name!r}; allowed: {', '.join(SETTINGS)}"]
    try:
        SETTINGS[name](value)
    except ValueError as exc:
        return [f"{shown_as} must be {exc}, got {'***' if name in SECRETS else repr(value)}"]
    return []


def apply_overrides(base: Settings, overrides: dict[str, Any]) -> Settings:
    """Validate and apply overrides {setting: raw}; raise SettingsError naming every bad key and the allowed values."""
    problems: list[str] = []
    for key, value in overrides.items():
        problems += _problem(key, value, f"setting {key!r}")
    if problems:
        raise SettingsError("; ".join(problems))
    return replace(base, **{key: SETTINGS[key](raw) for key, raw in overrides.items()})


def cli_value(text: str) -> Any:
    """A value given on a command line, read as `pyinfra --data KEY=VALUE` reads it (pyinfra_cli.util
    parse_cli_arg): true/false, an integer, JSON (a list such as ["--enable-log-requests"]), else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for parse in (int, json.loads):
        with contextlib.suppress(ValueError):
            return parse(text)
    return text


def parse_set(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings to a dict, each value read as `pyinfra --data` reads it."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE; keys: {', '.join(HOST_KEYS.values())}")
        out[key.strip()] = cli_value(value)
    return out


def settings_from_host_data(data: Any) -> dict[str, Any]:
    """The settings' host-data keys (HOST_KEYS) that are set, as raw overrides for apply_overrides."""
    settings: dict[str, Any] = {}
    for key, host_key in HOST_KEYS.items():
        value = data.get(host_key)
        if value is not None and not (key in SECRETS and value == ""):
            settings[key] = value
    return settings


def power_caps(gpu_count: int, s: Settings) -> dict[int, int]:
    """{GPU index: watts} for `gpu_count` GPUs: power_limit_w each, but the per-GPU overrides (power_limits) win
    over the one cap."""
    return {i: s.power_limit_w for i in range(gpu_count)} | dict(s.power_limits)


# ---------------------------------------------------------------- checks for the roles' own knobs


def _must(key: str, value: Any, what: str, deploy: bool = False) -> list[str]:
    """`deploy`: the deploy checks' form (`key=VALUE must be ...`)."""
    return [f"{key}={value!r} must be {what}." if deploy else f"{key} must be {what}, got {value!r}"]


def boolean(data: Mapping, key: str, deploy: bool = False) -> list[str]:
    """[] when `data[key]` is true or false; else the problem."""
    return [] if data.get(key) in (True, False) else _must(key, data.get(key), "true or false", deploy)


def integer(data: Mapping, key: str, low: int, high: int, unit: str = "") -> list[str]:
    """[] when `data[key]` is a whole number (or its digits) in low..high; else the problem."""
    value = data.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, str) and value.isdigit()
    return [] if ok and low <= int(value) <= high else _must(key, value, f"a whole number{unit} in {low}..{high}")


def choice(data: Mapping, key: str, allowed: tuple, deploy: bool = False) -> list[str]:
    """`deploy`: the deploy checks' form (`key=VALUE is not one of: ...`)."""
    if (value := data.get(key)) in allowed:
        return []
    names = ", ".join(map(str, allowed))
    return [f"{key}={value!r} is not one of: {names}." if deploy else f"{key} must be one of: {names}; got {value!r}"]


def matches(
    data: Mapping, key: str, pattern: re.Pattern, what: str, *, optional: bool = False, deploy: bool = False
) -> list[str]:
    """[] when `data[key]` is a string `pattern` matches (or absent when `optional`); else the one problem, saying it
    must be `what` (`deploy`: in the deploy checks' form, "key=VALUE must be ...")."""
    value = data.get(key)
    ok = value is None and optional or isinstance(value, str) and pattern.fullmatch(value)
    return [] if ok else _must(key, value, what, deploy)


def hostname(data: Mapping, key: str, optional: bool = False) -> list[str]:
    return matches(data, key, HOSTNAME, "a host name or IP address", optional=optional)


def http_url(data: Mapping, key: str, who: str) -> list[str]:
    return matches(data, key, HTTP_URL, f"an http(s) URL {who}", optional=True)


def settings(data: Mapping, names: dict[str, str]) -> list[str]:
    """Problems of rendering settings ({setting name: host-data key}) set in `data` (None = not set)."""
    return [p for name, key in names.items() if data.get(key) is not None for p in _problem(name, data[key], key)]
