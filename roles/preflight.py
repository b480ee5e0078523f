"""Preflight: runs first, changes nothing, and stops a host that cannot run its variant (OS, GPUs, VRAM, caps,
CUDA, disk, the role switches; and the host state the driver and container-runtime roles own: the driver package
exists and is published, no unowned driver is overwritten, no hand-made apt source clashes with rigforge's,
daemon.json is a JSON object) with one message naming the host, the key and what to do. The refusal is printed
while the deploy is prepared, so `pyinfra --dry` shows it and exits 1.
"""

import re
from collections.abc import Mapping

from pyinfra import host, logger
from pyinfra.facts.deb import DebArch
from pyinfra.facts.files import FileContents

from rigforge import driver_table
from rigforge.facts.apt import AptSourceFiles, DebInstalledVersion, PublishedPackages
from rigforge.facts.nvidia import NvidiaGpus, NvidiaPciGpus, NvidiaRunningDriver, unowned_driver
from rigforge.facts.system import FreeDiskBytes, OsRelease, SecureBoot
from rigforge.hardware import Needs, find_problems, format_problems
from rigforge.layout import DAEMON_JSON
from roles import docker_engine, nvidia_driver
from roles.operations import apt_repo, docker_daemon
from roles.operations.checks import refuse_now
from roles.operations.shown import warn


def host_state_problems(data: Mapping, os_release: dict, arch: str, running: dict, sources: dict) -> list[str]:
    """Pure: every problem of the driver / container-runtime host state (empty when fine); `data`'s keys were
    validated with the plan (rigforge/fleet.py plan_for)."""
    data, problems = {**nvidia_driver.DEFAULTS, **docker_engine.DEFAULTS, **data}, []
    manage = data["nvidia_driver_manage"]
    if manage:
        try:
            driver_table.packages_for(data, os_release.get("id", ""))
        except driver_table.DriverTableError as error:
            problems.append(f"{error}.")
        if unowned_driver(running):
            problems.append(
                f"NVIDIA driver {running['version']} is running but no package owns {running['smi']} (NVIDIA's .run "
                "installer or a hand build); rigforge will not install packages over it: set "
                "nvidia_driver_manage: false to keep it, or remove it (nvidia-uninstall) and re-run."
            )
    elif problem := driver_table.branch_problem(running, int(data["nvidia_driver_branch"])):
        problems.append(problem)
    repos = []
    if manage and data["nvidia_driver_source"] == "cuda":
        repos.append((nvidia_driver.cuda_repo(data, os_release, arch)[0], nvidia_driver.KEY_NAME))
    if data["docker_source"] == "docker":
        repos.append((docker_engine.docker_repo_url(data, os_release.get("id", "")), "rigforge-docker"))
    repos.append((docker_engine.toolkit_repo_url(data, arch), "rigforge-nvidia-container-toolkit"))
    for uri, repo in repos:
        problems += apt_repo.source_problems(sources, uri, repo, data["apt_adopt_sources"], "apt_adopt_sources")
    return problems


def unpublished(data: Mapping, url: str, packages: driver_table.DriverPackages, published: list[str]) -> str | None:
    """Pure: the refusal when NVIDIA's repository at `url` does not publish a package the driver branch needs."""
    wanted = [name.split("=")[0] for name in (packages.pinning, *packages.install) if name]
    missing = [name for name in wanted if name not in published]
    if not missing:
        return None
    branches = sorted({int(m[1]) for n in published if (m := re.fullmatch(r"nvidia-driver-pinning-(\d+)", n))})
    offer = f"; it publishes driver branches {', '.join(map(str, branches))}" if branches else ""
    return (
        f"nvidia_driver_branch {data['nvidia_driver_branch']}: NVIDIA's repository {url} does not publish "
        f"{', '.join(missing)}{offer}: set nvidia_driver_branch to a published branch (nothing was installed)."
    )


def branch_published(data: Mapping) -> list[str]:
    """While the CUDA repository's driver packages are not installed: does the repository publish the branch asked
    for (its index read with curl, not through /etc/apt)? An unreadable index is a warning, never a refusal."""
    if not data["nvidia_driver_manage"] or data["nvidia_driver_source"] != "cuda":
        return []
    os_release = host.get_fact(OsRelease)
    packages = driver_table.packages_for(data, os_release.get("id", ""))  # host_state_problems checked it
    if host.get_fact(DebInstalledVersion, package=packages.pinning or packages.version_package):
        return []  # installed: the branch was published, and a no-op asks nothing
    url = nvidia_driver.cuda_repo(data, os_release, host.get_fact(DebArch) or "amd64")[0]
    published = host.get_fact(PublishedPackages, url=url)
    if published is None:
        warn(
            f"WARNING: could not read NVIDIA's package index at {url} to check that driver branch "
            f"{data['nvidia_driver_branch']} is published; the install will say so if it is not"
        )
        return []
    problem = unpublished(data, url, packages, published)
    return [problem] if problem else []


def check(needs: Needs, data: Mapping, more: list[str] = ()) -> bool:
    """Refuse this host now, while the deploy is prepared, when it cannot run `needs.variant`; True when it can.
    `data`: the plan's validated host data; `more`: problems found on the controller (roles/site.py)."""
    problems = find_problems(
        host.get_fact(OsRelease),
        host.get_fact(NvidiaGpus),
        host.get_fact(FreeDiskBytes, path=needs.disk_path),
        needs=needs,
        data=data,
        pci=host.get_fact(NvidiaPciGpus),
        running=host.get_fact(NvidiaRunningDriver),
    )
    # the driver and container-runtime roles' host-state checks, then the controller's
    found = host_state_problems(
        data,
        host.get_fact(OsRelease),
        host.get_fact(DebArch) or "amd64",
        host.get_fact(NvidiaRunningDriver),
        host.get_fact(AptSourceFiles),
    )
    problems, lines = problems + found, host.get_fact(FileContents, path=DAEMON_JSON)
    try:
        docker_daemon.merged_text(None if lines is None else "\n".join(lines), {})
    except ValueError as error:
        problems.append(
            f"{DAEMON_JSON} on {host.name} is not valid JSON ({error}); rigforge merges the nvidia runtime into it and "
            "never overwrites it: fix it (no comments, no trailing commas) or remove it, then re-run."
        )
    problems += (branch_published(data) if not found else []) + list(more)
    if host.get_fact(SecureBoot) == "enabled":
        host.log_styled(
            "Secure Boot is enabled: DKMS-built NVIDIA modules must be signed with an enrolled MOK key; on Ubuntu, "
            "nvidia_driver_source: ubuntu installs Ubuntu's prebuilt, signed modules instead.",
            fg="yellow",
            log_func=logger.warning,
        )
    if problems:
        refuse_now(f"Preflight refused {host.name}", format_problems(host.name, problems))
        return False
    host.noop(f"preflight passed for {needs.variant}")
    return True
