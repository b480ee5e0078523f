"""What the controller asks upstream before a change (issue 22, docs/registry.md). Where a rig gets its locked image:
the rig, the fleet registry, upstream; asked over HTTP, and the one line naming the variant's live successor when
none has it. And whether the hub lets the HF token read a gated asset (`token_refused`)."""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rigforge.model.pins import DIGEST, HfPin
from rigforge.model.registry import RegistryPlan

if TYPE_CHECKING:  # imported where used: requests is slow to import
    import requests

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "https://registry-1.docker.io"  # where Docker itself asks for docker.io images
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
IMAGE_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
MANIFEST_TYPES = ", ".join(INDEX_TYPES + IMAGE_TYPES)


def registry_request(
    method: str, url: str, headers: dict, extra: dict | None = None, **kwargs: Any
) -> "requests.Response":
    """One Distribution API request (+ `extra` headers); a bearer token a 401 asks for is kept in `headers`."""
    import requests

    kwargs.setdefault("timeout", 30)
    resp = requests.request(method, url, headers=headers | (extra or {}), **kwargs)
    challenge = resp.headers.get("WWW-Authenticate", "")
    if resp.status_code == 401 and challenge.lower().startswith("bearer "):
        resp.close()
        params = requests.utils.parse_dict_header(challenge[7:])
        token = requests.get(params.pop("realm"), params=params, timeout=30).json()
        headers["Authorization"] = f"Bearer {token.get('token') or token.get('access_token')}"
        resp = requests.request(method, url, headers=headers | (extra or {}), **kwargs)
    return resp


@dataclass(frozen=True)
class ImageRef:
    registry: str  # "docker.io", or the host[:port] the reference names
    repository: str  # "vllm/vllm-openai" ("library/x" for Docker Hub's official images)
    tag: str | None
    digest: str | None

    @property
    def on_docker_hub(self) -> bool:
        return self.registry == DOCKER_HUB

    @property
    def pinned(self) -> str:
        """What `ref` says, by digest when it has one (`vllm/vllm-openai@sha256:...`)."""
        name = self.repository.removeprefix("library/") if self.on_docker_hub else f"{self.registry}/{self.repository}"
        return f"{name}@{self.digest}" if self.digest else f"{name}:{self.tag or 'latest'}"


def parse(image: str) -> ImageRef:
    """`[host[:port]/]name[:tag][@sha256:...]` as Docker reads it (a first part with '.' or ':', or 'localhost',
    is a registry host; otherwise Docker Hub, whose one-part names live under library/)."""
    rest, _, digest = image.partition("@")
    if digest and not DIGEST.match(digest):
        raise ValueError(f"{image!r}: the digest must be sha256:<64 hex>")
    name, _, tag = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", None)
    first, _, after = name.partition("/")
    if after and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, after
    else:
        registry, repository = DOCKER_HUB, name if "/" in name else f"library/{name}"
    return ImageRef(registry, repository, tag, digest or None)


def fleet_repository(ref: ImageRef) -> str:
    """Where the fleet registry holds `ref`'s image: a Docker Hub image under its own repository (the path Docker asks
    a mirror for: `vllm/vllm-openai`), any other registry's under that registry's host too
    (`ghcr.io/ggml-org/llama.cpp`), as pull-through caches name them, so two registries' images never share one."""
    return ref.repository if ref.on_docker_hub else f"{ref.registry}/{ref.repository}"


def pulled_as(image: str, fleet: RegistryPlan | None) -> str:
    """The reference a rig pulls and runs the locked `image` (`ref@sha256:...`) by. Itself for a Docker Hub image
    (Docker asks the fleet registry first, as its mirror, and records the image under its Docker Hub name), and with
    no fleet registry or no digest. Another registry's image (ghcr.io's) is pulled from the fleet registry's copy by
    its digest, `FLEET/ghcr.io/ggml-org/llama.cpp:tag@sha256:...`: Docker uses mirrors for Docker Hub images only,
    and records an image under the name it was pulled by, so the compose file names the fleet's copy."""
    ref = parse(image)
    if fleet is None or ref.on_docker_hub or not ref.digest:
        return image
    tag = f":{ref.tag}" if ref.tag else ""
    return f"{fleet.endpoint}/{fleet_repository(ref)}{tag}@{ref.digest}"


@dataclass(frozen=True)
class Source:
    name: str  # "the fleet registry 127.0.2.1:5000", "upstream (docker.io)"
    kind: str  # "fleet" or "upstream"
    has: bool | None  # None: it could not be asked
    detail: str  # "HTTP 404", "unreachable: ..." ("" when it has it)


def ask(base: str, ref: ImageRef, verify: bool | str) -> tuple[bool | None, str]:
    """(does the registry at `base` have `ref`'s manifest (by digest, else tag), why not): one HEAD request."""
    import requests

    url = f"{base.rstrip('/')}/v2/{ref.repository}/manifests/{ref.digest or ref.tag or 'latest'}"
    try:
        resp = registry_request("HEAD", url, {"Accept": MANIFEST_TYPES}, verify=verify)
    except (requests.RequestException, ValueError, KeyError, OSError) as e:
        return None, f"unreachable: {type(e).__name__}: {str(e)[:160]}"
    if resp.status_code == 200:
        return True, ""
    return (False if resp.status_code in (404, 401, 403) else None), f"HTTP {resp.status_code}"


def sources(image: str, fleet: RegistryPlan | None, upstream: str | None, upstream_ca: str | None) -> list[Source]:
    """Every place the rig's locked `image` (the lock's reference, not `pulled_as`) can come from, asked now: the
    fleet registry (its copy at `fleet_repository`), then upstream (for Docker Hub images `upstream` when set:
    serving_image_upstream). A Docker Hub image the fleet lacks is pulled from upstream; any other registry's image
    comes to the rig through the fleet's copy, which the registry host fills from upstream earlier in the same run."""
    ref = parse(image)
    out = []
    if fleet is not None:
        verify = False if fleet.insecure else str(Path(fleet.ca_dir) / "ca.crt")  # the fleet CA (plain HTTP: none)
        has, why = ask(fleet.url, replace(ref, repository=fleet_repository(ref)), verify)
        out.append(Source(f"the fleet registry {fleet.endpoint}", "fleet", has, why))
    base = (upstream or DOCKER_HUB_API) if ref.on_docker_hub else f"https://{ref.registry}"
    has, why = ask(base, ref, upstream_ca or True)
    out.append(Source(f"upstream ({ref.registry})", "upstream", has, why))
    return out


def problem(image: str, found: list[Source], successor: str | None) -> str | None:
    """The one line when no source has `image` (what each answered, the way on); None if one has it or was not asked."""
    if any(s.has is not False for s in found):
        return None
    answers = "; ".join(f"{s.name}: {s.detail}" for s in found)
    way = f"move to the recipe repo's live successor: rigforge_variant: {successor}"
    if not successor:
        way = "move to a variant with a live image (`rigforge render --list`)"
    return (
        f"image {image} is in no source this rig can pull from ({answers}), and the rig does not hold it: {way}, "
        "or `rigforge images load DIR` a saved copy onto the rig"
    )


def unasked(image: str, found: list[Source]) -> str | None:
    """The warning when no source is known to have `image` but some could not be asked (the pull may fail)."""
    if any(s.has for s in found) or all(s.has is False for s in found):
        return None
    answers = "; ".join(f"{s.name}: {s.detail}" for s in found)
    return f"could not tell whether any source has image {image} ({answers}); the pull may fail"


def origin(on_rig: bool, found: list[Source]) -> tuple[str, bool]:
    """(where the image comes from, as status says it: the fleet, upstream or the rig alone; whether to warn)."""
    have = [s.kind for s in found if s.has]
    unknown = [s.name for s in found if s.has is None]
    if "fleet" in have:
        upstream = next(s for s in found if s.kind == "upstream")  # `sources` always asks it
        if upstream.has is False:
            text = "the fleet registry (gone upstream)"
        elif upstream.has:
            text = "the fleet registry and upstream"
        else:
            text = f"the fleet registry ({upstream.name} could not be asked)"
    elif "upstream" in have:
        text = "upstream"
    elif on_rig:
        asked = f" (not asked: {', '.join(unknown)})" if unknown else ""
        return f"this rig alone: no other copy exists{asked}; keep one with `rigforge images save DIR`", True
    elif unknown:
        return f"no source known to have it (could not ask: {', '.join(unknown)}); not on the rig", True
    else:
        return "nowhere: not on the rig, in no source", True
    return text + ("" if on_rig else "; not on the rig yet"), False


def token_refused(endpoint: str, pin: HfPin, token: str) -> tuple[str | None, str | None]:
    """(problem, warning) of the HF token for a gated asset: a HEAD of one locked file at the pinned revision. A
    refused token is a problem; an unreachable hub only a warning (the rig may reach it). The token is never shown."""
    import requests

    url = f"{endpoint.rstrip('/')}/{pin.repo}/resolve/{pin.revision}/{pin.files[0].path}"
    try:
        answer = requests.head(url, headers={"Authorization": f"Bearer {token}"}, allow_redirects=False, timeout=10)
    except requests.RequestException as exc:
        return None, f"could not check the HF token with {endpoint} ({type(exc).__name__}); the rig's download tries it"
    if answer.status_code in (401, 403):
        return (
            f"the HF token was refused by {endpoint} for the gated {pin.repo} (HTTP {answer.status_code}): set a "
            "token that has access to it (host data hf_token or RIGFORGE_HF_TOKEN / HF_TOKEN on the controller)",
            None,
        )
    return None, None
