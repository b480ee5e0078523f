"""Saved images onto a rig at their locked digests (`rigforge images load DIR INVENTORY`, issue 22), through a
temporary registry on the rig since `docker load` drops the repository digest: docs/images.md.
"""

from pyinfra.api import deploy
from pyinfra.operations import apt, systemd

from rigforge.layout import HostLayout
from rigforge.model import saved_images
from roles.operations import images as image_ops

REGISTRY_UNIT = "docker-registry.service"  # Debian's package starts it; only the load's own registry runs


@deploy("Load saved images")
def load(
    directory: str,
    saved: list[saved_images.Saved],
    layout: HostLayout,
    port: int | None = None,
    registry_host: bool = False,
) -> None:
    """Every image of `saved` (from `directory` on the controller) in the rig's Docker at its digest.
    `registry_host`: the rig also serves the fleet registry (its docker-registry service is left alone)."""
    image_ops.repaired(
        name="Repair what an interrupted image load left (daemon.json, temporary registry)", layout=layout
    )

    def needed() -> bool:
        return bool(image_ops.missing(saved))

    apt.packages(
        name="Install Debian's docker-registry (the load's temporary registry) and curl",
        packages=["docker-registry", "curl"],
        _if=needed,
    )
    if not registry_host:
        systemd.service(
            name=f"Keep {REGISTRY_UNIT} stopped and disabled (only the load's own registry runs)",
            service=REGISTRY_UNIT,
            running=False,
            enabled=False,
            _if=needed,
        )
    image_ops.blobs_uploaded(
        name=f"Upload the saved images' blobs the rig lacks to {layout.images_layout}",
        directory=directory,
        saved=saved,
        layout=layout,
    )
    image_ops.loaded(
        name="Load the saved images into docker at their digests (a temporary registry on 127.0.0.1)",
        directory=directory,
        saved=saved,
        layout=layout,
        port=port,
    )
