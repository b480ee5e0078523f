"""apt repositories the modern way (deb822 .sources + a Signed-By keyring in /etc/apt/keyrings, no apt-key),
plus two small package operations: install only what is missing, and hold packages only when not held.
"""

from __future__ import annotations

import re
from io import StringIO

from pyinfra import host
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files

from roles.facts.system import AptHeldPackages

KEYRING_DIR = "/etc/apt/keyrings"
SOURCES_DIR = "/etc/apt/sources.list.d"


def deb822_source(
    uris: str,
    suites: str,
    signed_by: str,
    components: str = "",
    architectures: str = "",
    comment: str = "",
) -> str:
    """Text of a deb822 .sources file. A flat repository has `suites="/"` and no components."""
    lines = [f"# {comment}"] if comment else []
    lines += ["Types: deb", f"URIs: {uris}", f"Suites: {suites}"]
    if components:
        lines.append(f"Components: {components}")
    if architectures:
        lines.append(f"Architectures: {architectures}")
    lines.append(f"Signed-By: {signed_by}")
    return "\n".join(lines) + "\n"


def keyring_path(name: str) -> str:
    return f"{KEYRING_DIR}/{name}.asc"


@deploy("Add apt repository")
def add_repo(
    repo: str,
    uris: str,
    suites: str,
    key_url: str,
    components: str = "",
    architectures: str = "",
    key_sha256: str | None = None,
):
    """Keyring + deb822 source for one repository; `apt-get update` only when either changed."""
    files.directory(name="Ensure the apt keyring directory", path=KEYRING_DIR, mode="755")
    key = files.download(
        name=f"Download the {repo} repository key",
        src=key_url,
        dest=keyring_path(repo),
        mode="644",
        sha256sum=key_sha256,
    )
    text = deb822_source(uris, suites, keyring_path(repo), components, architectures, "managed by rigforge")
    source = files.put(
        name=f"Add the {repo} apt source (deb822)",
        src=StringIO(text),
        dest=f"{SOURCES_DIR}/{repo}.sources",
        mode="644",
    )
    apt.update(
        name=f"Refresh apt lists after adding {repo}",
        _if=lambda: key.did_change() or source.did_change(),
    )


@operation()
def install_missing(packages: list[str]):
    """Install the packages that are not installed yet, refreshing apt lists first; nothing when all present.

    `name=version` entries pin a version (and count as missing when another version is installed).
    """
    installed = host.get_fact(DebPackages)
    missing = []
    for spec in packages:
        name, _, version = spec.partition("=")
        versions = installed.get(name) or []
        if not versions or (version and version not in versions):
            missing.append(spec)
    if not missing:
        host.noop(f"already installed: {', '.join(packages)}")
        return
    yield "apt-get update"
    yield from apt.packages._inner(packages=missing, allow_downgrades=True)


@operation()
def hold(packages: list[str], installed_pattern: str = ""):
    """`apt-mark hold` the installed ones of `packages` and those matching `installed_pattern`, unless held."""
    installed = host.get_fact(DebPackages)
    pattern = re.compile(installed_pattern) if installed_pattern else None
    wanted = {name for name in installed if name in packages or (pattern and pattern.match(name))}
    to_hold = sorted(wanted - set(host.get_fact(AptHeldPackages)))
    if not to_hold:
        host.noop(f"already held: {', '.join(sorted(wanted)) or 'nothing installed to hold'}")
        return
    yield StringCommand("apt-mark", "hold", *to_hold)
