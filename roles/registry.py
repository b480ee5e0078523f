"""The fleet registry: Debian's docker-registry (CNCF Distribution 2.8) on the host of the inventory group
`registry` (opt-in), a plain registry over TLS signed by the fleet's CA, or plain HTTP with `registry_insecure`;
and on every rig, Docker's trust in it (docs/registry.md).
"""

import shlex

from pyinfra.api import deploy
from pyinfra.operations import apt, server

from rigforge.model import registry
from rigforge.model.registry import RegistryPlan
from roles.operations import docker_daemon, fleet_copy, systemd_units
from roles.operations.checks import refuse_now
from roles.operations.staged import staged_files

UNIT = "docker-registry.service"
USER = "docker-registry"  # Debian's unit runs the registry as this user: it must read the key
# the key and certificate belong together (same public key); then the key goes to the registry's user
KEY_CHECK = (
    f'[ "$(openssl x509 -noout -pubkey -in {registry.TLS_CERT})" = "$(openssl pkey -pubout -in {registry.TLS_KEY})" ]'
    f" && chown {USER}:{USER} {registry.TLS_KEY}"
)


@deploy("Fleet registry (Distribution)")
def serve(
    reg: RegistryPlan,
    tls: tuple[str, str] | None,
    manage_services: bool,
    ca: str | None = None,
    images: tuple[str, ...] = (),
) -> None:
    """On the registry host: the registry, serving `tls` = (certificate, key) PEM (None: plain HTTP), holding
    `images` (the rigs' locked images) copied from upstream by skopeo, which trusts the fleet CA `ca` in certs.d."""
    text = registry.render_config(reg)
    if problems := registry.check_config(text, tls=not reg.insecure):
        refuse_now(f"Refuse {reg.host}: the registry config is not valid", "; ".join(problems))
        return
    apt.packages(
        name="Install Debian's docker-registry (Distribution), skopeo and openssl",
        packages=["docker-registry", "skopeo", "openssl"],
    )
    certs = None
    if tls:
        certs = staged_files(
            name=f"Install the registry's certificate for {reg.address} (signed by the fleet CA) and its key",
            dest=registry.TLS_DIR,
            files={registry.TLS_CERT: (tls[0], "644"), registry.TLS_KEY: (tls[1], "600")},
            validate=KEY_CHECK,
            keep_previous=False,
        )
    # rendered and checked on the controller (rigforge/model/registry.py check_config: YAML, required keys), since
    # docker-registry has no command that checks a config without serving it; staged, then renamed into place
    config = staged_files(
        name=f"Install the registry config ({reg.url}, storage {registry.STORAGE})",
        dest=registry.CONFIG_DIR,
        files={registry.CONFIG: (text, "644")},
        validate=f"test -s {shlex.quote(registry.CONFIG)}",
    )
    if manage_services:
        changed = lambda: config.did_change() or bool(certs and certs.did_change())  # noqa: E731
        systemd_units.running(
            UNIT, at_boot=True, restarted=(f"Restart {UNIT} on its new config or certificate", changed)
        )
        _ca_in_certs_d(reg, ca)  # skopeo reads /etc/docker/certs.d too
        for image in images:  # before any rig pulls: the rigs' pulls come later in the run (roles/site.py)
            fleet_copy.image_in_fleet(name=f"Fill the fleet registry: {image}", image=image, reg=reg)


def _ca_in_certs_d(reg: RegistryPlan, ca: str | None) -> None:
    """The fleet CA's certificate `ca` in Docker's certs.d for the registry's endpoint (None: nothing to trust)."""
    if ca is None:
        return
    staged_files(
        name=f"Trust the fleet registry {reg.endpoint} (the fleet CA in {registry.CERTS_D})",
        dest=f"{registry.CERTS_D}/{reg.endpoint}",
        files={"ca.crt": (ca, "644")},
        keep_previous=False,
    )


@deploy("Trust the fleet registry")
def trust(reg: RegistryPlan, ca: str | None, daemon_json: str, manage_services: bool) -> None:
    """On a rig: the fleet CA's certificate `ca` where Docker looks for it (`ca` None: the registry in daemon.json's
    insecure-registries), and the registry first in daemon.json's registry-mirrors, for Docker Hub images."""
    _ca_in_certs_d(reg, ca)
    daemon = docker_daemon.merge_json(
        name=f"Ask the fleet registry {reg.url} before Docker Hub (daemon.json registry-mirrors)",
        path=daemon_json,
        patch={},
        extend={"registry-mirrors": [reg.url]} | ({} if ca is not None else {"insecure-registries": [reg.endpoint]}),
    )
    if manage_services:
        server.shell(
            name="Reload docker for the fleet registry (a reload: running containers keep running)",
            commands=["systemctl try-reload-or-restart docker.service"],
            _if=daemon.did_change,
        )
