"""roles/interrupt.py: an interrupted run exits 128 + the signal's number, whatever saying so costs."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from support import REPO

SCRIPT = """
import os, signal, sys, time
from roles import interrupt

class Broken:  # a state whose hosts cannot be read at the moment of the signal
    @property
    def inventory(self):
        raise RuntimeError("read while the run was being torn down")

interrupt.install(Broken() if sys.argv[1] == "broken" else None)
os.kill(os.getpid(), int(sys.argv[2]))
time.sleep(5)
sys.exit(0)  # not reached: the signal ends the run
"""


@pytest.mark.parametrize("state", ["none", "broken"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_run_with_its_code_even_when_naming_the_cut_fails(state, signum):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, state, str(int(signum))], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 128 + signum, proc.stderr
    if state == "none":
        assert f"interrupted by {signum.name}, cut before any operation ran" in proc.stderr
