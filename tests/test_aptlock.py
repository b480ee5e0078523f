"""The apt/dpkg lock another process holds (issue 32 case 4): its holder as the kernel names it, and the wait."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time

from roles.operations import aptlock


def test_the_holder_line_is_parsed_and_described():
    line = "/var/lib/dpkg/lock-frontend 4242 /usr/bin/python3 /usr/bin/unattended-upgrade --download-only"
    holder = aptlock.parse([line])
    assert holder == {
        "lock": "/var/lib/dpkg/lock-frontend",
        "pid": 4242,
        "command": "/usr/bin/python3 /usr/bin/unattended-upgrade --download-only",
    }
    assert aptlock.describe(holder) == (
        "the apt/dpkg lock /var/lib/dpkg/lock-frontend is held by pid 4242 (/usr/bin/python3 "
        "/usr/bin/unattended-upgrade --download-only)"
    )
    no_proc = aptlock.parse("/var/lib/dpkg/lock 7 ")  # /proc not mounted: the pid alone
    assert aptlock.describe(no_proc) == "the apt/dpkg lock /var/lib/dpkg/lock is held by pid 7"
    assert aptlock.parse([]) is None and aptlock.parse("") is None


def test_perl_names_a_holder_of_an_fcntl_lock_and_the_wait_ends_when_it_is_released(tmp_path, monkeypatch):
    """The rig-side commands against real fcntl locks (as apt and dpkg take them), with the lock paths moved."""
    lock = tmp_path / "lock-frontend"
    lock.touch()
    monkeypatch.setattr(aptlock, "HOLDER", aptlock.HOLDER.replace(" ".join(aptlock.LOCKS), f"{tmp_path}/none {lock}"))
    holder = f"import fcntl, time; f = open({str(lock)!r}, 'w'); fcntl.lockf(f, fcntl.LOCK_EX); time.sleep(3)"
    proc = subprocess.Popen([sys.executable, "-c", holder])
    try:
        for _ in range(50):  # until the holder has the lock
            out = subprocess.run(["sh", "-c", aptlock.HOLDER], capture_output=True, text=True).stdout
            if out:
                break
            time.sleep(0.1)
        found = aptlock.parse(out)
        assert found["lock"] == str(lock) and found["pid"] == proc.pid
        assert found["command"].startswith(f"{sys.executable} -c import fcntl")  # the command line, cut at 80
        held = subprocess.run(["sh", "-c", aptlock.wait_script(1)], capture_output=True, text=True).stdout
        assert held.startswith(f"HELD {lock} {proc.pid} "), held
        freed = subprocess.run(["sh", "-c", aptlock.wait_script(30)], capture_output=True, text=True).stdout
        assert freed.startswith("FREE "), freed
    finally:
        proc.kill()
    with open(lock, "w") as f:  # free: nothing printed
        fcntl.lockf(f, fcntl.LOCK_UN)
    assert subprocess.run(["sh", "-c", aptlock.HOLDER], capture_output=True, text=True).stdout == ""
