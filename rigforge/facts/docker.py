"""Docker facts: what the engine already holds."""

from pyinfra.api import QuoteString, StringCommand

from rigforge.facts import Fact


class DockerImagePresent(Fact):
    """Whether the engine holds ``image`` (``docker image inspect``); False also without an engine."""

    def command(self, image: str) -> StringCommand:
        return StringCommand("docker", "image", "inspect", QuoteString(image), ">/dev/null 2>&1 && echo yes || echo no")

    def process(self, output: list[str]) -> bool:
        return bool(output) and output[0].strip() == "yes"


class RegistryHasImage(Fact):
    """Whether the registry at `endpoint` holds `repository@digest` (`skopeo inspect --raw`); False also without it."""

    def command(self, endpoint: str, repository: str, digest: str, tls_verify: bool = True) -> StringCommand:
        return StringCommand(
            "skopeo", "inspect", "--raw", f"--tls-verify={'true' if tls_verify else 'false'}",
            QuoteString(f"docker://{endpoint}/{repository}@{digest}"),
            ">/dev/null 2>&1 && echo yes || echo no",
        )  # fmt: skip

    process = DockerImagePresent.process
