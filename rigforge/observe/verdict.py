"""One verdict per resource: is it on the rig as declared? Each function takes what the plan declares and what was
observed on the rig (facts, as read) and lists what differs; an empty list means "as declared".

The operation that manages a resource changes the rig exactly when its list is not empty, and `rigforge status` and
`verify` (rigforge/observe/drift.py) show the same list: nothing else decides. Pure: no host, no I/O.
"""

import hashlib
import json
from collections.abc import Mapping, Sequence

from rigforge.model.jsonmerge import merged_text
from rigforge.model.packages import PackageSet
from rigforge.model.pins import GitPin, HfPin
from rigforge.observe.facts.nvidia import upstream_version

# ---------------------------------------------------------------- a git checkout


def sparse_patterns(sparse: Sequence[str]) -> list[str]:
    """Non-cone sparse-checkout patterns: each path anchored at the top of the tree."""
    return ["/" + p.lstrip("/") for p in sparse]


def checkout(pin: GitPin, path: str, state: dict | None, commit: str | None = None, label: str = "lock") -> list[str]:
    """The checkout at `path` (GitCheckout) against `pin`: its commit (`commit` instead, named `label`, when given),
    a clean tree, origin's URL and the sparse patterns."""
    want = commit or pin.commit
    if state is None:
        return [f"git {pin.name}: no checkout at {path}"]
    if not want:
        return [f"git {pin.name}: no resolved commit to compare with"]
    problems = []
    if state["head"] != want:
        problems.append(f"git {pin.name}: HEAD {str(state['head'])[:12] or '?'}, {label} {want[:12]}")
    if state["dirty"]:
        n, first = len(state["dirty"]), state["dirty"][0].strip()
        problems.append(f"git {pin.name}: dirty checkout at {path} ({n} file(s), e.g. {first})")
    if state["url"] != pin.url:
        problems.append(f"git {pin.name}: origin is {state['url'] or 'not set'}, lock {pin.url}")
    patterns = sparse_patterns(pin.sparse)
    if state["sparse"] != bool(pin.sparse) or (pin.sparse and state["patterns"] != patterns):
        have = ", ".join(state["patterns"]) if state["sparse"] else "off"
        problems.append(f"git {pin.name}: sparse checkout {have}, lock {', '.join(patterns) or 'off'}")
    return problems


def files_not_locked(state: dict | None, files: Mapping[str, str]) -> list[str]:
    """The lock's files (`{path: sha256}`) whose sha256 in the checkout is another: the lock's error, not the rig's."""
    return [p for p, sha in files.items() if (state or {}).get("files", {}).get(p) != sha]


# ---------------------------------------------------------------- a weights asset


def stale_weights(pin: HfPin, state: dict) -> dict[str, str]:
    """{file: why} for each locked file of the asset (WeightsState) not as its stamp verified it: the files the
    download must fetch or re-verify (by size and mtime: nothing is re-hashed)."""
    stamp = state.get("stamp") or {}
    entries = stamp.get("files") or {} if stamp.get("revision") == pin.revision else {}
    out = {}
    for f in pin.files:
        entry, on_disk = entries.get(f.path) or {}, state["files"].get(f.path)
        if not stamp:
            why = "not verified yet (no stamp)"
        elif stamp.get("revision") != pin.revision:
            why = f"stamped at revision {str(stamp.get('revision'))[:12]}, lock {str(pin.revision)[:12]}"
        elif entry.get("sha256") != f.sha256 or entry.get("size") != f.size:
            why = "not stamped with the lock's sha256"
        elif on_disk is None:
            why = "missing"
        elif on_disk[0] != f.size:
            why = f"is {on_disk[0]} bytes, lock {f.size}"
        elif on_disk[1] != entry.get("mtime_ns"):
            why = "modified since it was verified (mtime differs from the stamp)"
        else:
            continue
        out[f.path] = why
    return out


def weights(pin: HfPin, dest: str, state: dict) -> list[str]:
    """The asset in `dest` (WeightsState) against `pin`: every file verified, no staging left by a cut download."""
    stale = stale_weights(pin, state)
    problems = []
    if stale and not (state.get("stamp") or {}):
        problems.append(f"hf {pin.name}: no stamp in {dest} ({len(stale)} file(s) not verified)")
    elif stale:
        shown = "; ".join(f"{path} {why}" for path, why in list(stale.items())[:3])
        problems.append(f"hf {pin.name}: {shown}{' ...' if len(stale) > 3 else ''}")
    if state.get("staging_dir"):
        problems.append(f"hf {pin.name}: a staging dir left by an interrupted download")
    return problems


# ---------------------------------------------------------------- a package set


def missing_packages(packages: PackageSet, installed: Mapping[str, list[str]] | None) -> list[str]:
    """The specs of `packages` that `installed` (DebPackages) lacks, a pinned one also when at another version."""
    installed = installed or {}
    missing = []
    for spec in packages.specs:
        name, _, version = spec.partition("=")
        versions = installed.get(name)
        if not versions or (version and version not in versions):
            missing.append(spec)
    return missing


def unheld_packages(
    packages: PackageSet, installed: Mapping[str, list[str]] | None, held: Sequence[str] | None
) -> list[str]:
    """Installed packages the set holds that apt does not hold (AptHeldPackages): its `held` names, and those with
    its `held_prefixes` at `held_with`'s upstream version (the driver's libraries)."""
    installed = installed or {}
    stack = {upstream_version(v) for v in installed.get(packages.held_with) or []} if packages.held_with else set()

    def holds(name: str, versions: list[str]) -> bool:
        if name in packages.held:
            return True
        in_stack = bool(stack & {upstream_version(v) for v in versions})
        return bool(packages.held_prefixes) and name.startswith(packages.held_prefixes) and in_stack

    wanted = {name for name, versions in installed.items() if holds(name, versions)}
    return sorted(wanted - set(held or ()))


def to_reinstall(
    packages: PackageSet, installed: Mapping[str, list[str]] | None, provided: Mapping[str, str | None] | None
) -> dict[str, str]:
    """{package: the file it lost} for each installed package whose file rigforge runs (the set's `provides`) is gone
    (ProvidedFiles: {missing path: the package dpkg says owns it, None: none}): reinstalling it puts the file back.
    The owner may be a dependency of the set (Debian's nvidia-smi package). A file that no package owns while the
    whole set is installed reinstalls the whole set."""
    out = {}
    complete = not missing_packages(packages, installed)
    for path, owner in (provided or {}).items():
        if owner:
            out[owner] = path
        elif owner is None and complete:
            out |= {name: path for name in packages.names}
    return out


def packages(
    packages: PackageSet,
    installed: Mapping[str, list[str]] | None,
    held: Sequence[str] | None,
    provided: Mapping[str, str | None] | None,
) -> list[str]:
    """The set against the rig: each package installed (at its pinned version), held where the set holds it, and
    the files rigforge runs present."""
    problems = []
    for spec in missing_packages(packages, installed):
        name, _, version = spec.partition("=")
        have = (installed or {}).get(name)
        problems.append(f"{name} is {f'at {have[0]}, lock {version}' if have else 'not installed'}")
    problems += [f"{name} is not held (apt-mark hold)" for name in unheld_packages(packages, installed, held)]
    reinstall = to_reinstall(packages, installed, provided)
    for path in sorted(set(reinstall.values())):
        owners = ", ".join(name for name, lost in reinstall.items() if lost == path)
        problems.append(f"{path} is missing, its package installed ({owners}): the deploy reinstalls it")
    return problems


# ---------------------------------------------------------------- a rendered file, a unit


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rendered_file(path: str, text: str, mode: str | None, info: dict | None, sha256: str | None) -> list[str]:
    """A file rigforge renders whole: present, with the plan's content (by sha256: no secret read) and `mode`
    (octal digits; None: not compared) as pyinfra's File fact reports it."""
    if not info:
        return [f"{path} is missing"]
    problems = []
    if sha256 != sha256_text(text):
        problems.append(f"{path} differs from what rigforge renders (edited on the rig? the deploy rewrites it)")
    if mode is not None and str(info.get("mode")) != mode.lstrip("0"):
        problems.append(f"{path} has mode {info.get('mode')}, rigforge's is {mode.lstrip('0')}")
    return problems


def unit_enabled(unit: str, enabled: bool | None, declared: bool = True) -> list[str]:
    """A unit rigforge enables at boot, or keeps disabled when not `declared` (SystemdUnitEnabled, as read)."""
    if declared:
        return [] if enabled else [f"{unit} is not enabled at boot"]
    return [f"{unit} is enabled at boot, declared disabled"] if enabled else []


# ---------------------------------------------------------------- the GPUs' caps and persistence


def caps(gpus: Sequence[dict], caps: Mapping[int, int]) -> list[str]:
    """Each GPU (NvidiaGpus) at its declared cap in whole watts (`caps`: {index: watts})."""
    problems = []
    for gpu in gpus:
        want, have = caps.get(gpu["index"]), gpu.get("power_limit")
        if want is not None and (have is None or round(have) != want):
            problems.append(f"GPU{gpu['index']} at {'?' if have is None else f'{have:g}'} W, declared {want} W")
    return problems


def persistence(gpus: Sequence[dict]) -> list[str]:
    """Persistence mode on for every GPU (NvidiaGpus; a card that does not report it is left alone)."""
    off = [str(gpu["index"]) for gpu in gpus if gpu.get("persistence_mode") is False]
    return [f"persistence mode off on GPU {', '.join(off)}"] if off else []


# ---------------------------------------------------------------- a merged JSON file (daemon.json)


def json_keys(path: str, current: dict | None, patch: dict, extend: dict | None = None) -> list[str]:
    """A JSON file rigforge merges keys into (`current`: its object as read, None: missing or not an object): it
    holds `patch`'s keys (nested mappings merged) and `extend`'s list items; the other keys are the user's."""
    if current is None:
        return [f"{path} is missing or not a JSON object"]
    merged = json.loads(merged_text(json.dumps(current), patch, extend) or json.dumps(current))
    differ = sorted(key for key in {**patch, **(extend or {})} if merged.get(key) != current.get(key))
    return [f"{path}: {key} is not as declared" for key in differ]


# ---------------------------------------------------------------- a rig's server at a fleet gateway

GATEWAY_WORDS = ("UP", "DOWN", "DRAIN", "MAINT")  # what status, verify and the fleet page call a server's state


def gateway_word(server: Mapping) -> str:
    """A server's state in one gateway backend (`observe.gateway_servers`' record) in one word: MAINT or DRAIN when
    taken out on purpose (HAProxy's admin state), else UP or DOWN by its health checks."""
    if server["admin"] == "maint":
        return "MAINT"
    if server["admin"] == "drain":
        return "DRAIN"
    return "UP" if server["up"] else "DOWN"


def gateway_said(server: Mapping) -> str:
    """The word, and for a DOWN server since when and its last check: 'DOWN (40 s; last check: L4CON ...)'."""
    word = gateway_word(server)
    if word != "DOWN":
        return word
    since = f"{server['since_s']} s; " if server.get("since_s") is not None else ""
    return f"DOWN ({since}last check: {server.get('last_check') or 'none yet'})"


def gateway_server(
    servers: Mapping[str, Mapping] | None, backend: str, port: int | None, rest: str | None
) -> list[str]:
    """One gateway's servers named after the rig (`{backend: record}`, as `observe.gateway_servers` reads them)
    against what the rig declares: in its model's `backend`, at its `port`, ready and UP; with `rest` (serving_rest),
    drained or in maintenance there. The deploy rejoins or drains the rig at that gateway exactly when this is not
    empty, and status shows it."""
    here = (servers or {}).get(backend)
    if here is None:
        return [f"not in backend {backend} (re-run the deploy on the gateway)"]
    word = gateway_said(here)
    if rest:
        if here["admin"] == "ready":
            return [f"{word}, declared drained (serving_rest: {rest})"]
        return []
    if here["admin"] != "ready":
        return [f"{word}, declared serving"]
    problems = []
    if port is not None and here.get("port") not in (None, port):
        problems.append(f"sent to port {here['port']}, the rig serves on {port}")
    if not here["up"]:
        problems.append(word)
    return problems
