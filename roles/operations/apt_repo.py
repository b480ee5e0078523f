"""apt repositories and packages. A repository is a deb822 source with a Signed-By keyring (no apt-key); another
source file whose entries all point at the same URI is moved to <file>.rigforge-bak, which apt skips silently. Packages:
install only what is missing, hold only what is not held, and remove what a replacement conflicts with only once the
replacement was fetched."""

from io import StringIO

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, deploy, operation
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files
from pyinfra.operations.util import any_changed

from rigforge.layout import APT_IGNORE_BACKUPS_CONF, APT_KEYRING_DIR, APT_SOURCES_DIR
from rigforge.model.packages import PackageSet
from rigforge.observe import verdict
from rigforge.observe.facts.apt import AptSourceFiles, KeyFingerprints, same_uri_files
from rigforge.observe.facts.system import AptHeldPackages, ProvidedFiles
from roles.operations.shown import Commands, say, unchanged


def deb822_source(
    uris: str, suites: str, signed_by: str, components: str = "", architectures: str = "", comment: str = ""
) -> str:
    """Text of a deb822 .sources file (a flat repository has `suites="/"` and no components)."""
    optional = {"Components": components, "Architectures": architectures}
    lines = [f"# {comment}"] if comment else []
    lines += ["Types: deb", f"URIs: {uris}", f"Suites: {suites}", *(f"{k}: {v}" for k, v in optional.items() if v)]
    return "\n".join([*lines, f"Signed-By: {signed_by}"]) + "\n"


BACKUP_SUFFIX = ".rigforge-bak"
IGNORE_BACKUPS_TEXT = (
    "// managed by rigforge: source files it replaced are kept as *.rigforge-bak; apt skips them silently\n"
    'Dir::Ignore-Files-Silently:: "\\.rigforge-bak$";\n'
)


def source_path(repo: str) -> str:
    """The deb822 .sources file rigforge writes for `repo`."""
    return f"{APT_SOURCES_DIR}/{repo}.sources"


def source_problems(files: dict[str, list[str]], uri: str, repo: str, adopt: bool, key: str) -> list[str]:
    """Preflight problems with source files already pointing at `uri`: a file that points at other repositories
    too, and (unless `adopt`) a file that points only at `uri`."""
    problems = []
    for path, only in sorted(same_uri_files(files, uri, source_path(repo)).items()):
        if not only:
            problems.append(
                f"{path} points at {uri} and at other repositories too; move the {uri} entry out of it "
                f"(rigforge writes {source_path(repo)} for it)."
            )
        elif not adopt:
            problems.append(
                f"{path} already points at {uri}; rigforge would write {source_path(repo)} with its own key "
                f"and apt would refuse both. Remove {path}, or set apt_adopt_sources: true to let rigforge "
                f"replace it (kept as {path}{BACKUP_SUFFIX}). ({key})"
            )
    return problems


@operation()
def adopt_sources(uris: str, keep: str) -> Commands:
    """Move every other apt source file whose entries all point at ``uris`` to ``<file>.rigforge-bak``.

    + uris: the repository URI
    + keep: the source file rigforge manages for it (not moved)

    **Example:**

    .. code:: python

        from roles.operations import apt_repo
        apt_repo.adopt_sources(
            name="Replace other apt sources for https://download.docker.com/linux/debian",
            uris="https://download.docker.com/linux/debian",
            keep="/etc/apt/sources.list.d/rigforge-docker.sources",
        )
    """
    found = same_uri_files(host.get_fact(AptSourceFiles), uris, keep)
    if unchanged(not found, f"no other source file points at {uris}"):
        return
    for path, only in sorted(found.items()):
        if not only:  # preflight refuses this; never half-edit a file holding other repositories
            yield StringCommand("echo", QuoteString(f"{path} also holds other repositories"), ">&2", "&&", "false")
            return
        yield StringCommand("mv", "-f", QuoteString(path), QuoteString(path + BACKUP_SUFFIX))


@operation()
def verified_key(src: str, dest: str, fingerprint: str | None = None, sha256: str | None = None) -> Commands:
    """Download a repository key to ``dest``, only when it has ``fingerprint`` (checked with gpg on the rig).

    + src: the key's URL
    + dest: the keyring file
    + fingerprint: the key's primary fingerprint (spaces ignored); without it the key is downloaded unchecked
    + sha256: the file's sha256, checked too when given

    **Example:**

    .. code:: python

        from roles.operations import apt_repo
        apt_repo.verified_key(
            name="Download the rigforge-docker repository key (fingerprint 0EBFCD88)",
            src="https://download.docker.com/linux/debian/gpg",
            dest="/etc/apt/keyrings/rigforge-docker.asc",
            fingerprint="9DC8 5822 9FC7 DD38 854A  E2D8 8D81 803C 0EBF CD88",
        )
    """
    if not fingerprint:
        yield from files.download._inner(src=src, dest=dest, mode="644", sha256sum=sha256)
        return
    fingerprint = fingerprint.replace(" ", "").upper()
    if unchanged(fingerprint in host.get_fact(KeyFingerprints, path=dest), f"{dest} is the key {fingerprint}"):
        return
    check_sum = f'echo "{sha256}  $tmp" | sha256sum -c --quiet - && ' if sha256 else ""
    script = (
        "tmp=$(mktemp) && trap 'rm -f \"$tmp\"' EXIT && "
        f'curl -fsSL {QUOTE(src)} -o "$tmp" && {check_sum}'
        "got=$(gpg --batch --show-keys --with-colons \"$tmp\" | awk -F: '/^pub/{p=1;next} /^fpr/&&p{print $10;p=0}'); "
        f'if echo "$got" | grep -qx {fingerprint}; then install -m 644 "$tmp" {QUOTE(dest)}; '
        f'else echo "refused {src}: key fingerprint ${{got:-none}}, expected {fingerprint}; '
        'apt was not given this key" >&2; exit 1; fi'
    )
    yield StringCommand("sh", "-c", QuoteString(script))


def QUOTE(text: str) -> str:  # noqa: N802 - a shell single-quoted word
    return "'" + text.replace("'", "'\\''") + "'"


def put_file(name: str, text: str, dest: str) -> OperationMeta:
    """A root-owned 0644 file holding `text` (apt sources, pins and settings; the nouveau blacklist)."""
    return files.put(name=name, src=StringIO(text), dest=dest, mode="644")


@deploy("Add apt repository")
def add_repo(
    repo: str,
    uris: str,
    suites: str,
    key_url: str,
    components: str = "",
    architectures: str = "",
    key_sha256: str | None = None,
    key_fingerprint: str | None = None,
) -> None:
    """Keyring + deb822 source for one repository; `apt-get update` only when something changed."""
    files.directory(name="Ensure the apt keyring directory", path=APT_KEYRING_DIR, mode="755")
    put_file("Let apt skip the source files rigforge replaced", IGNORE_BACKUPS_TEXT, APT_IGNORE_BACKUPS_CONF)
    keyring = f"{APT_KEYRING_DIR}/{repo}.asc"
    adopted = adopt_sources(name=f"Replace other apt sources for {uris}", uris=uris, keep=source_path(repo))
    key = verified_key(
        name=f"Download the {repo} repository key"
        + (f" (fingerprint {key_fingerprint.replace(' ', '')[-8:]})" if key_fingerprint else ""),
        src=key_url,
        dest=keyring,
        fingerprint=key_fingerprint,
        sha256=key_sha256,
    )
    text = deb822_source(uris, suites, keyring, components, architectures, "managed by rigforge")
    source = put_file(f"Add the {repo} apt source (deb822)", text, source_path(repo))
    apt.update(name=f"Refresh apt lists after adding {repo}", _if=any_changed(key, source, adopted))


@operation()
def install_missing(packages: PackageSet | list[str], change_held: bool = False) -> Commands:
    """Install what ``rigforge.observe.verdict.packages`` finds missing of a package set, refreshing apt lists
    first: the packages not installed (or at another pinned version), and a reinstall of those whose file rigforge runs
    is gone.

    + packages: the set (``rigforge.model.packages.PackageSet``), or package names; ``name=version`` pins a version
    + change_held: let apt replace held versions of these packages (``--allow-change-held-packages``)

    A Debian 13 rig set up with ``apt-get install --no-install-recommends docker.io`` lacks docker-cli
    (``/usr/bin/docker``); the distro Docker set installs it.

    **Examples:**

    .. code:: python

        from rigforge.model import packages
        from roles.operations import apt_repo
        apt_repo.install_missing(
            name="Install apt repository prerequisites",
            packages=["ca-certificates", "curl", "gpg"],
        )

        # a package set, e.g. the driver's; held versions may move (the toolkit's pinned version)
        apt_repo.install_missing(
            name="Install the NVIDIA driver",
            packages=packages.driver(plan.knobs.driver, "debian"),
            change_held=True,
        )
    """
    wanted = packages if isinstance(packages, PackageSet) else PackageSet("", tuple(packages))
    installed = host.get_fact(DebPackages)
    provided = host.get_fact(ProvidedFiles, paths=list(wanted.provides)) if wanted.provides else {}
    to_install = verdict.missing_packages(wanted, installed)
    pinned = {spec.partition("=")[0]: spec for spec in wanted.specs}
    to_reinstall = [pinned.get(name, name) for name in verdict.to_reinstall(wanted, installed, provided)]
    if unchanged(not to_install and not to_reinstall, f"already installed: {', '.join(wanted.specs)}"):
        return
    yield "apt-get update"
    held = "--allow-change-held-packages" if change_held else None
    if to_install:
        yield say(f"installing {', '.join(to_install)} (apt)")
        yield from apt.packages._inner(packages=to_install, allow_downgrades=True, extra_install_args=held)
    if to_reinstall:
        lost = ", ".join(sorted(provided))
        yield say(f"reinstalling {', '.join(to_reinstall)} (apt): {lost} missing")
        names = " ".join(QUOTE(spec) for spec in to_reinstall)
        yield (
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --reinstall --allow-change-held-packages "
            f"-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold {names}"
        )


@operation()
def hold(packages: PackageSet) -> Commands:
    """``apt-mark hold`` the set's installed packages that ``rigforge.observe.verdict.unheld_packages`` finds not held:
    its ``held`` names, and with ``held_with``, its ``held_prefixes`` packages at that version (the driver's libraries).

    + packages: the set (``rigforge.model.packages.PackageSet``)

    **Example:**

    .. code:: python

        from rigforge.model import packages
        from roles.operations import apt_repo
        apt_repo.hold(
            name="Hold the NVIDIA driver packages",
            packages=packages.driver(plan.knobs.driver, "debian"),
        )
    """
    to_hold = verdict.unheld_packages(packages, host.get_fact(DebPackages), host.get_fact(AptHeldPackages))
    if unchanged(not to_hold, f"already held: {', '.join(packages.held) or 'nothing to hold'}"):
        return
    yield StringCommand("apt-mark", "hold", *to_hold)


@operation()
def remove_installed(packages: list[str], replaced_by: list[str]) -> Commands:
    """``apt-get remove`` the installed ones of ``packages``, only once the replacement's packages were fetched.

    + packages: package names; those not installed are skipped
    + replaced_by: the packages that replace them, fetched first

    **Example:**

    .. code:: python

        from roles.operations import apt_repo
        apt_repo.remove_installed(
            name="Remove the distribution's conflicting Docker packages",
            packages=["docker.io", "docker-compose", "containerd", "runc"],
            replaced_by=["docker-ce", "docker-ce-cli", "containerd.io"],
        )
    """
    installed = host.get_fact(DebPackages)
    present = [name for name in packages if name in installed]
    if unchanged(not present, f"none installed: {', '.join(packages)}"):
        return
    why = QUOTE(
        f"rigforge: could not fetch {' '.join(replaced_by)}: nothing removed, {', '.join(present)} left "
        "installed and running"
    )
    yield say(f"fetching {', '.join(replaced_by)} before removing {', '.join(present)}")
    apt_get = "DEBIAN_FRONTEND=noninteractive apt-get"
    fetch = f"{apt_get} update -qq && {apt_get} install -y -qq --download-only {' '.join(map(QUOTE, replaced_by))}"
    yield f"{{ {fetch}; }} || {{ echo {why} >&2; exit 1; }}"
    yield from apt.packages._inner(packages=present, present=False)
