"""Preflight's one pass over the remote sources this run would fetch from (packages missing, checkouts or weights
not at their pin), one curl each in one round trip from the rig: HTTP 404 or 410 refuses the host, a source that
cannot be asked or answers otherwise is a warning (the step that fetches says more).
"""

from typing import NamedTuple

from pyinfra import host, logger
from pyinfra.facts.deb import DebArch, DebPackages

from rigforge.facts.gitpin import GitCheckout
from rigforge.facts.system import OsRelease, UrlAnswers
from rigforge.fleet import Plan
from rigforge.knobs.docker_engine import DockerEngine
from roles import docker_engine
from roles.operations.apt_repo import missing
from roles.operations.gitpin import is_current
from roles.operations.hfweights import stale_files
from roles.operations.shown import warn

CURL_EXITS = {6: "no such host name", 7: "connection refused", 28: "timed out", 35: "TLS failed", 60: "TLS: unknown CA"}


class Source(NamedTuple):
    what: str  # "Docker's repository", "git remote vllm-src", ...
    url: str  # what is asked
    fix: str  # what to do when it says no


def needed(plan: Plan, weights_state) -> list[Source]:
    """The sources this run would fetch from; `weights_state(plan, asset)` reads the weights' stamp."""
    data, knobs = plan.data, DockerEngine.of(plan.data)
    installed = host.get_fact(DebPackages) or {}
    os_release = host.get_fact(OsRelease) or {}
    out = []
    os_id = os_release.get("id", "debian")
    docker = docker_engine.docker_packages("docker", os_id, knobs.docker_package_versions)
    if knobs.docker_source == "docker" and missing(docker, installed):
        url = docker_engine.docker_repo_url(data, os_id)
        suite = os_release.get("codename", "")
        fix = f"it has no '{suite}' suite: check docker_repo_url, or use docker_source: distro"
        out.append(Source("Docker's repository", f"{url}/dists/{suite}/InRelease", fix))
    if missing(docker_engine.toolkit_packages(plan.toolkit_version), installed):
        url = docker_engine.toolkit_repo_url(data, host.get_fact(DebArch) or "amd64").rstrip("/")
        out.append(Source("NVIDIA's container toolkit repository", f"{url}/InRelease", "check nvidia_toolkit_repo_url"))
    for pin in plan.sources:
        state = host.get_fact(GitCheckout, path=plan.layout.src(pin.name), files=tuple(dict(pin.files)))
        if pin.url.startswith(("http://", "https://")) and not is_current(state, pin.url, pin.commit, pin.sparse):
            out.append(Source(f"git remote {pin.name}", f"{pin.url}/info/refs?service=git-upload-pack",
                              f"check git.{pin.name}.url in the lock"))  # fmt: skip
    endpoint = data["hf_endpoint"].rstrip("/")
    for asset in plan.assets:
        if not asset.pin.gated and stale_files(asset.pin, weights_state(plan, asset)):  # gated: the token check asks
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


def problems(plan: Plan, weights_state) -> list[str]:
    """Ask every needed source once, from the rig; warn about those that could not be asked, return the refusals."""
    sources = needed(plan, weights_state)
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
        host.log_styled(f"{host.name}: {fine} of {len(sources)} remote sources this run fetches from answer ({asked})",
                        log_func=logger.info)  # fmt: skip
    return [refusal for refusal, _ in verdicts if refusal]
