"""apt facts: a rig's sources (one-line .list, deb822 .sources; a second file for a URI with another keyring, e.g.
a hand-set-up `docker.list` or NVIDIA's `cuda-*.list`, breaks every `apt-get update`: "Conflicting values set for
option Signed-By"), a key file's fingerprints, dpkg's state.
"""

import re
import shlex

from rigforge.observe.facts import Fact, sections

SOURCE_FILES = "/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources"
_MARK = "==> rigforge-source-file "


def normalize_uri(uri: str) -> str:
    """URIs that name the same repository compare equal (trailing slash, case of scheme/host)."""
    uri = uri.strip().rstrip("/")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{slash}{path}"


def parse_one_line(text: str) -> list[str]:
    """URIs of the enabled `deb`/`deb-src` lines of a one-line .list file: each line's first word after `deb` or
    `deb-src` and its options (`[...]`, up to the first `]`); a comment (`#` to the end of the line) is ignored."""
    uris = []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if not entry.startswith(("deb ", "deb-src ", "deb\t", "deb-src\t")):
            continue
        rest = entry.split(None, 1)[1].strip()  # after `deb`/`deb-src`: the options, if any, then the URI
        if rest.startswith("["):
            rest = rest.split("]", 1)[1].strip() if "]" in rest else ""
        if rest:
            uris.append(rest.split()[0])
    return uris


def parse_deb822(text: str) -> list[str]:
    """URIs of the enabled stanzas of a deb822 .sources file."""
    uris = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0] in " \t" and key:
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() != "no" and "uris" in fields:
            uris += fields["uris"].split()
    return uris


class AptSourceFiles(Fact[dict[str, list[str]]]):
    """{path: [URI, ...]} of the rig's apt source files (files with no enabled entry are kept, empty)."""

    command = f'for f in {SOURCE_FILES}; do [ -f "$f" ] || continue; echo "{_MARK}$f"; cat "$f"; echo; done'

    def process(self, lines: list[str]) -> dict[str, list[str]]:
        files = sections(lines, _MARK)
        return {p: (parse_deb822 if p.endswith(".sources") else parse_one_line)("\n".join(b)) for p, b in files.items()}


def same_uri_files(files: dict[str, list[str]], uri: str, keep: str) -> dict[str, bool]:
    """Files other than `keep` with an entry for `uri`: {path: True when every entry in it is for `uri`}."""
    want = normalize_uri(uri)
    same = {path: [normalize_uri(u) == want for u in uris] for path, uris in files.items() if path != keep}
    return {path: all(flags) for path, flags in same.items() if any(flags)}


class KeyFingerprints(Fact[list[str]]):
    """Primary-key fingerprints (upper case) of an armored or binary key file (empty when absent or unreadable)."""

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return (
            f"[ -f {quoted} ] && command -v gpg >/dev/null 2>&1 && gpg --batch --show-keys --with-colons {quoted} "
            "2>/dev/null || true"
        )

    def process(self, lines: list[str]) -> list[str]:
        fprs, primary = [], False
        for line in lines:
            fields = line.split(":")
            if fields[0] in ("pub", "sub"):
                primary = fields[0] == "pub"
            elif fields[0] == "fpr" and primary and len(fields) > 9:
                fprs.append(fields[9].upper())
                primary = False
        return fprs


class DpkgInterrupted(Fact[str | None]):
    """Why dpkg needs ``--configure -a`` (``"dpkg was interrupted; not fully installed: docker.io"``), from its
    journal dir and ``dpkg --audit`` (both work in that state), or None when its state is clean."""

    command = (
        "if [ -n \"$(ls -A /var/lib/dpkg/updates 2>/dev/null)\" ]; then echo 'journal: dpkg was interrupted'; fi; "
        "dpkg --audit 2>&1 | grep -E '^ [a-z0-9][a-z0-9+.-]+ ' | head -n 20 | sed 's/^ /audit: /'; true"
    )

    def process(self, output: list[str]) -> str | None:
        lines = [line.strip() for line in output]
        packages = sorted({line.split()[1] for line in lines if line.startswith("audit:") and len(line.split()) > 1})
        reasons = ["dpkg was interrupted"] if any(line.startswith("journal:") for line in lines) else []
        reasons += [f"not fully installed: {', '.join(packages)}"] if packages else []
        return "; ".join(reasons) or None


class DebInstalledVersion(Fact[str | None]):
    """The version of an installed Debian package ("580.95.05-1"), or None (not installed, config files only)."""

    requires_command = "dpkg-query"

    def command(self, package: str) -> str:
        return f"dpkg-query -W -f '${{db:Status-Status}} ${{Version}}\\n' {shlex.quote(package)} 2>/dev/null || true"

    def process(self, output: list[str]) -> str | None:
        words = (output[0] if output else "").split()
        return words[1] if len(words) > 1 and words[0] == "installed" else None


class PublishedPackages(Fact[list[str] | None]):
    """Sorted package names the flat apt repository at `url` publishes (its Packages[.gz] by curl); None: unreadable."""

    def command(self, url: str) -> str:
        base = shlex.quote(url.rstrip("/") + "/")
        return (
            f"{{ curl -fsSL --max-time 30 {base}Packages.gz | gzip -dc 2>/dev/null || "
            f"curl -fsSL --max-time 30 {base}Packages; }} 2>/dev/null | sed -n 's/^Package: *//p' | sort -u"
        )

    def process(self, output: list[str]) -> list[str] | None:
        return sorted({line.strip() for line in output if line.strip()}) or None
