"""Preflight: runs first, changes nothing, and stops a host that cannot run its variant with one message naming the
host, the key and what to do, printed while the deploy is prepared (so `pyinfra --dry` shows it and exits 1): the
hardware, OS and role switches; the host state the driver and container-runtime roles own (the driver package exists
and is published, no unowned driver is overwritten, no hand-made apt source clashes with rigforge's, daemon.json is a
JSON object); the remote sources this run fetches from, one curl each in one round trip from the rig (HTTP 404 or 410
refuses, other failures warn).
"""

import re
from collections.abc import Mapping
from typing import NamedTuple

from pyinfra import host, logger
from pyinfra.facts.deb import DebArch, DebPackages
from pyinfra.facts.files import FileContents

from rigforge.layout import DAEMON_JSON
from rigforge.model import driver_table, packages, schema
from rigforge.model.fleet import Plan
from rigforge.model.hardware import Needs, data_root_left, data_root_of, find_problems, format_problems
from rigforge.model.jsonmerge import merged_text
from rigforge.model.knobs.docker_engine import DockerEngine
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.schema import Settings
from rigforge.observe.facts.apt import AptSourceFiles, DebInstalledVersion, PublishedPackages
from rigforge.observe.facts.docker import DataRootLeft
from rigforge.observe.facts.gitpin import GitCheckout
from rigforge.observe.facts.nvidia import NvidiaGpus, NvidiaPciGpus, NvidiaRunningDriver, NvidiaTopology
from rigforge.observe.facts.system import FreeDiskBytes, OsRelease, SecureBoot, UrlAnswers
from rigforge.observe.verdict import checkout, missing_packages, stale_weights
from roles import docker_engine, nvidia_driver
from roles.operations import apt_repo
from roles.operations.checks import refuse_now
from roles.operations.shown import warn

CURL_EXITS = {6: "no such host name", 7: "connection refused", 28: "timed out", 35: "TLS failed", 60: "TLS: unknown CA"}


class Source(NamedTuple):
    what: str  # "Docker's repository", "git remote vllm-src", ...
    url: str  # what is asked
    fix: str  # what to do when it says no


def sources_needed(plan: Plan, weights: Mapping[str, dict]) -> list[Source]:
    """The sources this run would fetch from; `weights`: {asset name: WeightsState}, each asset's stamp as read."""
    knobs = plan.knobs.docker
    installed = host.get_fact(DebPackages) or {}
    os_release = host.get_fact(OsRelease) or {}
    out = []
    os_id = os_release.get("id", "debian")
    docker = packages.docker("docker", os_id, os_release.get("version_id", ""), knobs.docker_package_versions)
    if knobs.docker_source == "docker" and missing_packages(docker, installed):
        url = docker_engine.docker_repo_url(knobs, os_id)
        suite = os_release.get("codename", "")
        fix = f"it has no '{suite}' suite: check docker_repo_url, or use docker_source: distro"
        out.append(Source("Docker's repository", f"{url}/dists/{suite}/InRelease", fix))
    if missing_packages(packages.toolkit(plan.toolkit_version), installed):
        url = docker_engine.toolkit_repo_url(knobs, host.get_fact(DebArch) or "amd64").rstrip("/")
        out.append(Source("NVIDIA's container toolkit repository", f"{url}/InRelease", "check nvidia_toolkit_repo_url"))
    for pin in plan.sources:
        path = plan.layout.src(pin.name)
        state = host.get_fact(GitCheckout, path=path, files=tuple(dict(pin.files)))
        if pin.url.startswith(("http://", "https://")) and checkout(pin, path, state):
            out.append(
                Source(
                    f"git remote {pin.name}",
                    f"{pin.url}/info/refs?service=git-upload-pack",
                    f"check git.{pin.name}.url in the lock",
                )
            )
    endpoint = plan.knobs.weights.hf_endpoint.rstrip("/")
    for asset in plan.assets:
        if not asset.pin.gated and stale_weights(asset.pin, weights[asset.name]):  # gated: the token check asks
            pin = asset.pin
            url = f"{endpoint}/api/models/{pin.repo}/revision/{pin.revision}"
            fix = f"check hf.{asset.name} in the lock (repo, revision) and hf_endpoint"
            out.append(Source(f"Hugging Face repository {pin.repo}", url, fix))
    return out


def verdict(source: Source, code: int, curl_exit: int) -> tuple[str | None, str | None]:
    """Pure: (the refusal, the warning) for what `source` answered; both None when it answers."""
    if 200 <= code < 400:
        return None, None
    if code in (404, 410):
        return f"{source.what} says HTTP {code} for {source.url}: {source.fix} (nothing was changed).", None
    said = f"HTTP {code}" if code else CURL_EXITS.get(curl_exit, f"curl exit {curl_exit}")
    return None, f"{source.what} could not be asked ({said}: {source.url}); the step that fetches from it will say more"


def remote_problems(plan: Plan, weights: Mapping[str, dict]) -> list[str]:
    """Ask every needed source once, from the rig; warn about those that could not be asked, return the refusals."""
    sources = sources_needed(plan, weights)
    if not sources:
        return []
    answers = host.get_fact(UrlAnswers, urls=tuple(s.url for s in sources))
    verdicts = [verdict(source, *answers.get(source.url, (0, 0))) for source in sources]
    for _, warning in verdicts:
        if warning:
            warn(f"WARNING: {warning}")
    fine = verdicts.count((None, None))
    if fine:  # said at default verbosity, so `--dry` shows what was asked (a re-run with nothing to fetch asks nothing)
        asked = ", ".join(s.what for s in sources)
        host.log_styled(
            f"{host.name}: {fine} of {len(sources)} remote sources this run fetches from answer ({asked})",
            log_func=logger.info,
        )
    return [refusal for refusal, _ in verdicts if refusal]


def unowned_driver(running: Mapping) -> bool:
    """Pure: whether `running` (NvidiaRunningDriver) is a driver that answers (nvidia-smi, a version in /proc) but that
    no package owns (NVIDIA's .run installer, a hand build)."""
    return bool(running.get("version") and running.get("smi_ok") and not running.get("owner"))


def host_state_problems(knobs: RoleKnobs, os_release: dict, arch: str, running: dict, sources: dict) -> list[str]:
    """Pure: every problem of the driver / container-runtime host state (empty when fine); `knobs` validated
    (fleet.py plan_for)."""
    driver, docker = knobs.driver, knobs.docker
    problems = []
    manage = driver.nvidia_driver_manage
    if manage:
        try:
            driver_table.packages_for(driver, os_release.get("id", ""))
        except driver_table.DriverTableError as error:
            problems.append(f"{error}.")
        if unowned_driver(running):
            problems.append(
                f"NVIDIA driver {running['version']} is running but no package owns {running['smi']} (NVIDIA's .run "
                "installer or a hand build); rigforge will not install packages over it: set "
                "nvidia_driver_manage: false to keep it, or remove it (nvidia-uninstall) and re-run."
            )
    elif problem := driver_table.branch_problem(running, int(driver.nvidia_driver_branch)):
        problems.append(problem)

    def clashes(uri: str, repo: str) -> list[str]:
        return apt_repo.source_problems(sources, uri, repo, driver.apt_adopt_sources, "apt_adopt_sources")

    if manage and driver.nvidia_driver_source == "cuda":
        problems += clashes(nvidia_driver.cuda_repo(driver, os_release, arch)[0], nvidia_driver.KEY_NAME)
    if docker.docker_source == "docker":
        problems += clashes(docker_engine.docker_repo_url(docker, os_release.get("id", "")), "rigforge-docker")
    return problems + clashes(docker_engine.toolkit_repo_url(docker, arch), "rigforge-nvidia-container-toolkit")


def unpublished(
    driver: NvidiaDriver, url: str, packages: driver_table.DriverPackages, published: list[str]
) -> str | None:
    """Pure: the refusal when NVIDIA's repository at `url` does not publish a package the driver branch needs."""
    wanted = [name.split("=")[0] for name in (packages.pinning, *packages.install) if name]
    missing = [name for name in wanted if name not in published]
    if not missing:
        return None
    branches = sorted({int(m[1]) for n in published if (m := re.fullmatch(r"nvidia-driver-pinning-(\d+)", n))})
    offer = f"; it publishes driver branches {', '.join(map(str, branches))}" if branches else ""
    return (
        f"nvidia_driver_branch {driver.nvidia_driver_branch}: NVIDIA's repository {url} does not publish "
        f"{', '.join(missing)}{offer}: set nvidia_driver_branch to a published branch (nothing was installed)."
    )


def branch_published(driver: NvidiaDriver, os_release: dict, arch: str) -> list[str]:
    """[refusal] when the CUDA repository (its index read with curl) lacks the driver branch, while the CUDA
    repository's driver packages are not installed; its index unreadable: a warning."""
    if not driver.nvidia_driver_manage or driver.nvidia_driver_source != "cuda":
        return []
    packages = driver_table.packages_for(driver, os_release.get("id", ""))  # host_state_problems checked it
    if host.get_fact(DebInstalledVersion, package=packages.pinning or packages.version_package):
        return []  # installed: the branch was published, and a no-op asks nothing
    url = nvidia_driver.cuda_repo(driver, os_release, arch)[0]
    published = host.get_fact(PublishedPackages, url=url)
    if published is None:
        warn(
            f"WARNING: could not read NVIDIA's package index at {url} to check that driver branch "
            f"{driver.nvidia_driver_branch} is published; the install will say so if it is not"
        )
        return []
    problem = unpublished(driver, url, packages, published)
    return [problem] if problem else []


def check(needs: Needs, knobs: RoleKnobs, settings: Settings, more: list[str] = ()) -> bool:
    """True when this host can run `needs.variant` with its `knobs` and `settings` (a plan's), else refuse it now;
    `more`: the controller's problems (site.py). Once it passed, warns of a Docker data-root this run leaves unused
    (hardware.data_root_left), deleting nothing."""
    os_release = host.get_fact(OsRelease)
    problems = find_problems(
        os_release,
        host.get_fact(NvidiaGpus),
        host.get_fact(FreeDiskBytes, path=needs.disk_path),
        needs=needs,
        knobs=knobs,
        settings=settings,
        pci=host.get_fact(NvidiaPciGpus),
        running=host.get_fact(NvidiaRunningDriver),
        topology=host.get_fact(NvidiaTopology) if needs.nvlink else None,  # read only for a slug that needs NVLink
    )
    problems += host_state(knobs, os_release) + list(more)  # then the controller's
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
    daemon_json = host.get_fact(FileContents, path=DAEMON_JSON)
    warn_data_root_left(knobs.docker, daemon_json)  # after the refusals: no warning comes before one
    return True


def host_state(knobs: RoleKnobs, os_release: dict) -> list[str]:
    """The driver and container-runtime roles' host-state checks with this host's facts (`host_state_problems`), the
    refusal when its daemon.json is not valid JSON, and, when the checks found nothing, whether NVIDIA's repository
    publishes the driver branch asked for (`branch_published`)."""
    arch = host.get_fact(DebArch) or "amd64"
    running, sources = host.get_fact(NvidiaRunningDriver), host.get_fact(AptSourceFiles)
    problems = host_state_problems(knobs, os_release, arch, running, sources)
    found_none = not problems
    daemon_json = host.get_fact(FileContents, path=DAEMON_JSON)
    try:
        merged_text(None if daemon_json is None else "\n".join(daemon_json), {})
    except ValueError as error:
        problems.append(
            f"{DAEMON_JSON} on {host.name} is not valid JSON ({error}); rigforge merges the nvidia runtime into it and "
            "never overwrites it: fix it (no comments, no trailing commas) or remove it, then re-run."
        )
    if found_none:
        problems += branch_published(knobs.driver, os_release, arch)
    return problems


def warn_data_root_left(docker: DockerEngine, daemon_json: list[str] | None) -> None:
    """Warn of a Docker data-root this run leaves unused (hardware.data_root_left), with its size; delete nothing."""
    after = data_root_after(docker, daemon_json)

    def size_of(path: str) -> int | None:
        return host.get_fact(DataRootLeft, path=path, data_root=after)

    if left := data_root_left(data_root_of(daemon_json), after, size_of):
        warn(f"WARNING: {left}")


def data_root_after(docker: DockerEngine, daemon_json: list[str] | None) -> str:
    """Docker's data-root once this run wrote daemon.json: docker_daemon_options' (validated), else the rig's."""
    options = docker.docker_daemon_options or {}
    return schema.docker_data_root(options["data-root"]) if "data-root" in options else data_root_of(daemon_json)
