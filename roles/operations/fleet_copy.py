"""Operation: the fleet registry holds an image at its locked digest, copied from upstream once."""

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from rigforge.model.registry import RegistryPlan
from rigforge.observe.facts.docker import RegistryHasImage
from rigforge.observe.obtain import fleet_repository, parse
from roles.operations.shown import Commands, ShownCommand, say, unchanged


@operation()
def image_in_fleet(image: str, reg: RegistryPlan) -> Commands:
    """Copy ``image`` from upstream into the fleet registry unless it holds that digest, every platform's manifest
    and the index byte for byte (``--preserve-digests``: the rigs pull the digest the lock names).

    + image: the locked image, ``[host/]repo[:tag]@sha256:...``: a Docker Hub image (rigs reach the copy as their
      mirror) or another registry's, held under that registry's host (``ghcr.io/ggml-org/llama.cpp``: rigs pull the
      copy by that name, ``obtain.pulled_as``)
    + reg: the fleet registry (its ``host:port``; plain HTTP, no certificate check, when ``insecure``)

    **Example:**

    .. code:: python

        from roles.operations import fleet_copy
        fleet_copy.image_in_fleet(
            name="Fill the fleet registry: vllm/vllm-openai",
            image=lock.pinned(lock.image.ref),  # repo[:tag]@sha256:...
            reg=registry_plan,  # rigforge.model.registry.RegistryPlan
        )
    """
    ref = parse(image)
    if unchanged(not ref.digest, f"{image} has no locked digest: nothing to copy (`rigforge lock` resolves it)"):
        return
    repository = fleet_repository(ref)  # where the fleet registry holds it
    held = host.get_fact(
        RegistryHasImage,
        endpoint=reg.endpoint,
        repository=repository,
        digest=ref.digest,
        tls_verify=not reg.insecure,
    )
    if unchanged(held, f"the fleet registry {reg.endpoint} holds {ref.pinned}"):
        return
    tag = ref.tag or ref.digest.replace(":", "-")[:40]  # the lock's tag, so `rigforge lock` can find it there
    yield say(f"copying {ref.pinned} from upstream into the fleet registry {reg.endpoint} (once for the fleet)")
    yield ShownCommand(
        "skopeo",
        "copy",
        "--all",
        "--preserve-digests",
        "--retry-times",
        "3",
        *(["--dest-tls-verify=false"] if reg.insecure else []),
        QuoteString(f"docker://{ref.registry}/{ref.repository}@{ref.digest}"),
        QuoteString(f"docker://{reg.endpoint}/{repository}:{tag}"),
    )
    yield StringCommand(
        "skopeo",
        "inspect",
        "--raw",
        f"--tls-verify={'false' if reg.insecure else 'true'}",
        QuoteString(f"docker://{reg.endpoint}/{repository}@{ref.digest}"),
        ">/dev/null",
    )
