"""Saved images onto a rig at their locked digests (`rigforge images load DIR INVENTORY`, issue 22): for a single
rig with no fleet registry, or a move between fleets. DIR is what `rigforge images save` wrote on the controller.

`docker load` drops the repository digest (moby#22011), so the images go through a registry: the blobs the rig
lacks are uploaded into an OCI layout on it (`<root>/images/oci`, each checked by sha256), then
rigforge/remote/load_images.sh runs Debian's `docker-registry` on 127.0.0.1 for the load, pushes the blobs and
manifests into it byte for byte, lists it first in daemon.json's registry-mirrors (the user's kept), reloads docker
(SIGHUP) and pulls `NAME@sha256:...`: Docker records that in its RepoDigests, so the compose file's `ref@digest`
resolves with no network. Its trap restores daemon.json byte for byte (after a reload that sets the user's own
mirrors explicitly: a reload keeps an option the file no longer sets) and stops the registry, on success and on
failure; a run killed outright is repaired by the next run's first operation. A no-op when Docker already holds
every image at its digest. Docker uses mirrors for Docker Hub only, so only its images (`vllm/vllm-openai`, ...)
load this way. (skopeo refuses an OCI layout whose index names Docker media types, as Docker Hub's often do: the
script pushes with curl, and the registry checks every digest.)
"""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.operations import apt, systemd

from rigforge import images
from rigforge.knobs.images import DEFAULTS
from rigforge.layout import DAEMON_JSON, HostLayout
from roles.operations import images as image_ops

REGISTRY_UNIT = "docker-registry.service"  # Debian's package starts it; only the load's own registry runs


@deploy("Load saved images", data_defaults=DEFAULTS)
def load(directory: str, saved: list[images.Saved], layout: HostLayout, port: int | None = None,
         registry_host: bool = False):  # fmt: skip
    """Every image of `saved` (from `directory` on the controller) in the rig's Docker at its digest.
    `registry_host`: the rig also serves the fleet registry (Debian's docker-registry service is left alone)."""
    work, script = layout.images_work, layout.images_script
    image_ops.repaired(name="Repair what an interrupted image load left (daemon.json, temporary registry)",
                       script=script, work=work, daemon_json=DAEMON_JSON)  # fmt: skip

    def needed() -> bool:
        return bool(image_ops.missing(saved))

    apt.packages(name="Install Debian's docker-registry (the load's temporary registry) and curl",
                 packages=["docker-registry", "curl"], _if=needed)  # fmt: skip
    if not registry_host:
        systemd.service(name=f"Keep {REGISTRY_UNIT} stopped and disabled (only the load's own registry runs)",
                        service=REGISTRY_UNIT, running=False, enabled=False, _if=needed)  # fmt: skip
    image_ops.blobs_uploaded(name=f"Upload the saved images' blobs the rig lacks to {layout.images_layout}",
                             directory=directory, saved=saved, layout=layout.images_layout,
                             upload_dir=layout.images_upload)  # fmt: skip
    image_ops.loaded(name="Load the saved images into docker at their digests (a temporary registry on 127.0.0.1)",
                     directory=directory, saved=saved, script=script, layout=layout.images_layout, work=work,
                     daemon_json=DAEMON_JSON, port=port, upload_dir=layout.images_upload)  # fmt: skip
