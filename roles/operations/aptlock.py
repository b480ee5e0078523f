"""The apt/dpkg lock another process holds (unattended-upgrades, a user's apt), waited for before a run's first
change. fcntl(F_GETLK), asked from Perl (every Debian and Ubuntu has it), names the holder's pid even without /proc;
its command line is read from /proc when it is mounted."""

import re
import shlex
from typing import TypedDict

from pyinfra import host, logger, state
from pyinfra.api import FactBase, FunctionCommand, Host, QuoteString, State, StringCommand, operation

from roles.operations.shown import Commands, unchanged, warn

LOCKS = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock", "/var/lib/apt/lists/lock", "/var/cache/apt/archives/lock")
# prints "<lock file> <pid> <command line>" of the first lock held, nothing when all are free
GETLK = (
    'use Fcntl; for $f (@ARGV) { open(my $h, "<", $f) or next; '
    'my $s = pack("s s x4 q q l x4", F_WRLCK, 0, 0, 0, 0); fcntl($h, F_GETLK, $s) or next; '
    'my ($t, $w, $a, $b, $p) = unpack("s s x4 q q l x4", $s); next if $t == F_UNLCK; my $c = ""; '
    'if (open(my $m, "<", "/proc/$p/cmdline")) { local $/; $c = <$m>; $c =~ s/\\0+$//; $c =~ s/\\0/ /g } '
    'print "$f $p $c\\n"; last }'
)
HOLDER = f"perl -e {shlex.quote(GETLK)} {' '.join(LOCKS)} 2>/dev/null"


class LockHolder(TypedDict):
    """The process holding an apt/dpkg lock (`parse`)."""

    lock: str  # the lock file
    pid: int  # its holder's pid (fcntl's F_GETLK)
    command: str  # its holder's command line, at most 80 characters


def parse(output: list[str] | str) -> LockHolder | None:
    """{"lock", "pid", "command"} from HOLDER's output; None when every lock is free."""
    text = (output if isinstance(output, str) else "\n".join(output)).strip()
    match = re.match(r"(?P<lock>\S+) (?P<pid>-?\d+) ?(?P<command>.*)", text)  # the first line
    if not match:
        return None
    command = " ".join(match["command"].split())[:80]
    return {"lock": match["lock"], "pid": int(match["pid"]), "command": command}


def describe(holder: LockHolder, held: str = "is held") -> str:
    """The lock and its holder in words: "the apt/dpkg lock /var/lib/dpkg/lock is held by pid 42 (apt-get ...)"."""
    who = f"pid {holder['pid']}" + (f" ({holder['command']})" if holder["command"] else "")
    return f"the apt/dpkg lock {holder['lock']} {held} by {who}"


class AptLockHolder(FactBase[LockHolder | None]):
    """The process holding an apt/dpkg lock (`parse`), None when every lock is free."""

    command = f"{HOLDER} || true"
    process = staticmethod(parse)


def wait_script(wait: int) -> str:
    """Shell: poll every second until the locks are free ("FREE <seconds>") or `wait` seconds passed ("HELD ...")."""
    return (
        f"start=$(date +%s); while :; do h=$({HOLDER}); now=$(date +%s); "
        f'if [ -z "$h" ]; then echo "FREE $((now - start))"; exit 0; fi; '
        f'if [ $((now - start)) -ge {int(wait)} ]; then echo "HELD $h"; exit 0; fi; sleep 1; done'
    )


def _wait(state: State, host: Host, wait: int, first: LockHolder, kwargs: dict) -> bool:
    """Wait on the rig up to `wait` s for the lock `first` held to be free: True (warned) once free, else False, the
    holder named (the host fails). A FunctionCommand's callback: pyinfra passes (state, host)."""
    ok, output = host.run_shell_command(StringCommand("sh", "-c", QuoteString(wait_script(wait))), **kwargs)
    lines = [line.strip() for line in output.stdout_lines if line.strip()]
    last = lines[-1] if lines else ""
    if ok and last.startswith("FREE "):
        warn(
            f"{describe(first, 'was held')} when the run was prepared; it was free after {last[5:]} s of waiting; "
            "going on"
        )
        return True
    holder = parse(last[5:]) if last.startswith("HELD ") else None
    said = describe(holder) if holder else f"the apt/dpkg lock could not be checked ({' '.join(lines)[:200]})"
    host.log_styled(
        f"rigforge refused on {host.name}: {said} after {wait} s of waiting (apt_lock_wait); nothing was changed: "
        "re-run once it is done, or raise apt_lock_wait.",
        fg="red",
        log_func=logger.error,
    )
    return False


@operation(is_idempotent=False)
def free(wait: int, sudo: dict | None = None) -> Commands:
    """Wait up to ``wait`` s for the apt/dpkg lock another process holds; fail the host, naming the holder, after.

    + wait: seconds to wait (host data ``apt_lock_wait``)
    + sudo: how this rig's commands run (``{"_sudo": True, "_sudo_user": ...}``), for the wait's own command

    **Example:**

    .. code:: python

        from roles.operations import aptlock
        aptlock.free(
            name="Wait for the apt/dpkg lock another process holds (up to 300 s)",
            wait=300,
            sudo={"_sudo": True},
        )
    """
    holder = host.get_fact(AptLockHolder)
    if unchanged(not holder, "the apt/dpkg lock is free"):
        return
    if not state.is_executing:
        warn(f"{describe(holder)}; the run waits up to {wait} s (apt_lock_wait) for it before its first change")
    yield FunctionCommand(_wait, (int(wait), holder, dict(sudo or {})), {})
