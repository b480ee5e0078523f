"""System facts: plain values, never failing the host for a missing tool or file (preflight decides what that means)."""

import re
import shlex
from typing import TypedDict

from pyinfra.api import QuoteString, StringCommand

from rigforge.observe.facts import Fact


class OsReleaseInfo(TypedDict):
    """What OsRelease reads of /etc/os-release ("" where it has no such line)."""

    id: str  # ID, e.g. "debian"
    version_id: str  # VERSION_ID, e.g. "13"
    codename: str  # VERSION_CODENAME (else UBUNTU_CODENAME), e.g. "trixie"


class OsRelease(Fact[OsReleaseInfo]):
    """ID, VERSION_ID and VERSION_CODENAME from /etc/os-release as {"id", "version_id", "codename"} (missing: "")."""

    command = "cat /etc/os-release 2>/dev/null || cat /usr/lib/os-release 2>/dev/null || true"

    def process(self, lines: list[str]) -> OsReleaseInfo:
        pairs = (line.strip().partition("=") for line in lines)
        items = {key: value.strip().strip("\"'") for key, sep, value in pairs if sep}
        codename = items.get("VERSION_CODENAME") or items.get("UBUNTU_CODENAME", "")
        return {"id": items.get("ID", ""), "version_id": items.get("VERSION_ID", ""), "codename": codename}


_EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-e39a1e3a5c0b"


class SecureBoot(Fact[str]):
    """Secure Boot state: "enabled", "disabled" or "unknown" (mokutil, else the EFI variable, else BIOS)."""

    command = (
        "if command -v mokutil >/dev/null 2>&1 && mokutil --sb-state 2>/dev/null; then :; "
        f"elif [ -r {_EFIVAR} ]; then echo efivar=$(od -An -t u1 -j 4 -N 1 {_EFIVAR} | tr -d ' '); "
        "elif [ -d /sys/kernel ] && [ ! -d /sys/firmware/efi ]; then echo noefi; "
        "else echo unknown; fi"
    )

    def process(self, lines: list[str]) -> str:
        text = " ".join(lines).lower()
        if "secureboot enabled" in text or text.strip() == "efivar=1":
            return "enabled"
        if "secureboot disabled" in text or text.strip() in ("efivar=0", "noefi"):
            return "disabled"
        return "unknown"


class FreeDiskBytes(Fact[int | None]):
    """Bytes available to unprivileged users on the filesystem holding `path` (or its nearest existing parent)."""

    def command(self, path: str) -> str:
        # `stat -f` asks statfs directly, so it works without /proc (chroots) unlike df.
        return f'p={shlex.quote(path)}; while [ ! -e "$p" ]; do p=$(dirname "$p"); done;stat -f -c \'%a %S\' "$p"'

    def process(self, output: list[str]) -> int | None:
        try:
            blocks, size = output[-1].split()
            return int(blocks) * int(size)
        except (IndexError, ValueError):
            return None


class AptHeldPackages(Fact[list[str]]):
    """Held package names, sorted: `apt-mark showhold`'s answer from dpkg-query (~8 ms; apt-mark's takes ~40 ms)."""

    requires_command = "dpkg-query"

    command = "dpkg-query -W -f '${db:Status-Want} ${Package}\\n' | awk '$1 == \"hold\" {print $2}'"

    def process(self, output: list[str]) -> list[str]:
        return sorted({line.strip() for line in output if line.strip()})


class SystemdUnitEnabled(Fact[bool]):
    """Whether a unit is enabled (`systemctl is-enabled`, which also works offline in a chroot)."""

    requires_command = "systemctl"

    def command(self, unit: str) -> StringCommand:
        return StringCommand("systemctl", "is-enabled", QuoteString(unit), "2>/dev/null || true")

    def process(self, output: list[str]) -> bool:
        state = output[0].strip() if output else ""
        return state in ("enabled", "enabled-runtime", "static", "alias")


class ProvidedFiles(Fact[dict[str, str | None]]):
    """{path: the package dpkg says owns it, or None} for each of ``paths`` missing on the host; present ones are
    left out, so a rig that has them all answers ``{}`` (`dpkg -S` runs only for a missing path)."""

    def command(self, paths: tuple[str, ...] | list[str]) -> str:
        checks = (
            f"[ -e {shlex.quote(p)} ] || echo {shlex.quote(p)}=$(dpkg -S {shlex.quote(p)} 2>/dev/null"
            " | grep -v '^diversion' | head -1 | cut -d: -f1)"
            for p in paths
        )
        return "; ".join([*checks, "true"])

    def process(self, output: list[str]) -> dict[str, str | None]:
        pairs = (line.strip().partition("=") for line in output if "=" in line)
        return {path: owner.split(",")[0].strip() or None for path, _, owner in pairs}


def _bre(text: str) -> str:
    """`text` as a literal in a grep basic regular expression."""
    return re.sub(r"([.\[\]\\*^$])", r"\\\1", text)


class EnabledInstances(Fact[list[str]]):
    """Instances of ``template`` (``name@.service``) enabled at boot in ``unit_dir``/multi-user.target.wants."""

    def command(self, unit_dir: str, template: str) -> str:
        prefix, _, suffix = template.partition("@")
        pattern = shlex.quote(f"{_bre(prefix)}@..*{_bre(suffix)}")
        return f"ls {shlex.quote(f'{unit_dir}/multi-user.target.wants/')} 2>/dev/null | grep -x -- {pattern} || true"

    def process(self, output: list[str]) -> list[str]:
        return sorted({line.strip() for line in output if line.strip()})


class LeftoverUploads(Fact[list[str]]):
    """Paths left in ``path`` (the SSH user's private upload dir) by an interrupted upload."""

    def command(self, path: str) -> str:
        return f"find {shlex.quote(path)} -mindepth 1 -maxdepth 1 2>/dev/null || true"

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]


class UrlAnswers(Fact[dict[str, tuple[int, int]]]):
    """`{url: (http_code, curl_exit)}` of a GET from the rig with curl, e.g. (200, 0); http_code 0: nothing answered."""

    def command(self, urls: tuple[str, ...]) -> str:
        asks = [
            f"c=$(curl -sS -o /dev/null -L --max-time 15 -w '%{{http_code}}' {shlex.quote(url)} 2>/dev/null); "
            f'printf \'%s %s %s\\n\' "$?" "$c" {shlex.quote(url)}'
            for url in urls
        ]
        return "; ".join(asks) or "true"

    def process(self, output: list[str]) -> dict[str, tuple[int, int]]:
        rows = ((line.strip().split(" ", 2) + ["", ""])[:3] for line in output)
        return {url: (int(code) if code.isdigit() else 0, int(e) if e.isdigit() else 0) for e, code, url in rows if url}
