"""Docker facts: what the engine already holds."""

import shlex

from pyinfra.api import QuoteString, StringCommand

from rigforge.observe.facts import Fact


class DockerImagePresent(Fact[bool]):
    """Whether the engine holds ``image`` (``docker image inspect``); False also without an engine."""

    def command(self, image: str) -> StringCommand:
        return StringCommand("docker", "image", "inspect", QuoteString(image), ">/dev/null 2>&1 && echo yes || echo no")

    def process(self, output: list[str]) -> bool:
        return bool(output) and output[0].strip() == "yes"


class RegistryHasImage(Fact[bool]):
    """Whether the registry at `endpoint` holds `repository@digest` (`skopeo inspect --raw`); False also without it."""

    def command(self, endpoint: str, repository: str, digest: str, tls_verify: bool = True) -> StringCommand:
        return StringCommand(
            "skopeo",
            "inspect",
            "--raw",
            f"--tls-verify={'true' if tls_verify else 'false'}",
            QuoteString(f"docker://{endpoint}/{repository}@{digest}"),
            ">/dev/null 2>&1 && echo yes || echo no",
        )

    process = DockerImagePresent.process


class DataRootLeft(Fact[int | None]):
    """The bytes (``du -sbx``) of the Docker data-root ``path`` Docker no longer uses; None when there is no such
    directory, or when it is the data-root in use, ``data_root``, under another name (a symlink or bind mount)."""

    def command(self, path: str, data_root: str) -> StringCommand:
        old, new = shlex.quote(path), shlex.quote(data_root)
        same = f'[ "$(stat -Lc %d:%i {old})" = "$(stat -Lc %d:%i {new} 2>/dev/null)" ]'
        return StringCommand(f"if [ -d {old} ] && [ ! -L {old} ] && ! {same}; then du -sbx {old} | cut -f1; fi")

    def process(self, output: list[str]) -> int | None:
        text = "".join(output).strip()
        return int(text) if text.isdigit() else None
