"""Facts for loading saved images (roles/images.py): the blobs an OCI layout on the rig holds, the TCP ports in use."""

import shlex

from rigforge.observe.facts import Fact


class OciBlobs(Fact[dict[str, int]]):
    """``{"sha256:<hex>": size}`` of the OCI image layout's blobs at ``path``, partial uploads left out."""

    def command(self, path: str) -> str:
        blobs = shlex.quote(f"{path.rstrip('/')}/blobs/sha256")
        return f"find {blobs} -maxdepth 1 -type f ! -name '.*' -printf '%f %s\\n' 2>/dev/null || true"

    def process(self, output: list[str]) -> dict[str, int]:
        lines = (line.strip().partition(" ") for line in output)
        return {f"sha256:{name}": int(size) for name, _, size in lines if len(name) == 64 and size.isdigit()}


class ListeningPorts(Fact[list[int]]):
    """The local TCP ports something listens on (IPv4 and IPv6, from /proc/net/tcp{,6}), as a sorted list."""

    command = "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null || true"

    def process(self, output: list[str]) -> list[int]:
        rows = [line.split() for line in output]
        listening = [row[1] for row in rows if len(row) > 3 and row[3] == "0A" and ":" in row[1]]  # state 0A: LISTEN
        return sorted({int(address.rsplit(":", 1)[1], 16) for address in listening})
