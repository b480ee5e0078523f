"""Facts for loading saved images (roles/images.py): the blobs an OCI layout on the rig holds, the TCP ports in use."""

from __future__ import annotations

from pyinfra.api import FactBase, QuoteString, StringCommand


class OciBlobs(FactBase):
    """
    The blobs of the OCI image layout at ``path`` (``blobs/sha256/<hex>``, partial uploads left out), as
    ``{"sha256:<hex>": size}``; empty when there is no layout::

        {"sha256:7b1f...": 375, "sha256:ba64...": 136}
    """

    def command(self, path: str) -> StringCommand:
        blobs = f"{path.rstrip('/')}/blobs/sha256"
        return StringCommand(
            "find", QuoteString(blobs), "-maxdepth 1 -type f ! -name '.*' -printf '%f %s\\n' 2>/dev/null || true"
        )

    default = dict

    def process(self, output: list[str]) -> dict[str, int]:
        blobs = {}
        for line in output:
            name, _, size = line.strip().partition(" ")
            if len(name) == 64 and size.isdigit():
                blobs[f"sha256:{name}"] = int(size)
        return blobs


class ListeningPorts(FactBase):
    """
    The local TCP ports something listens on (IPv4 and IPv6, from /proc/net/tcp{,6}), as a sorted list::

        [22, 5000, 8011]
    """

    command = "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null || true"

    default = list

    def process(self, output: list[str]) -> list[int]:
        ports = set()
        for line in output:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and ":" in fields[1]:  # state 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return sorted(ports)
