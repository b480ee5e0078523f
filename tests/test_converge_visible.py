"""Tier 4: a first converge is visible at pyinfra's default verbosity (no -v), on a fresh testbed rig.

`pyinfra -y INVENTORY deploy/dual_turbo.py` as a user runs it; its output is read line by line as it arrives.
The HF stand-in is throttled so each weight shard takes longer than 10 s: the download must still show
progress at least every 10 s and a completion line (asset, file, bytes done / total, rate). The package
installs say what they install, the checkouts show git's progress, and the GPU fact on the driver-less rig
prints no pyinfra warning. The second run changes nothing and is quiet.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
from support import PYINFRA, REPO

from rigforge.model.driver_table import packages_for
from rigforge.model.knobs.nvidia_driver import NvidiaDriver

pytestmark = pytest.mark.testbed
THROTTLE_BPS = 20 * 1024  # a 256 KiB shard takes about 13 s


def run_timed(tb) -> tuple[int, list[tuple[float, str]]]:
    """Run the deploy at default verbosity; return (rc, [(seconds since start, line)])."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [PYINFRA, "-y", "--limit", "rig1", str(tb.inventory), "deploy/dual_turbo.py"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
    return proc.wait(timeout=1200), lines


def test_first_converge_shows_progress_at_default_verbosity(testbed_factory):
    tb = testbed_factory(name="visible")
    tb.hf_control(throttle_bps=THROTTLE_BPS)
    try:
        rc, lines = run_timed(tb)
    finally:
        tb.hf_control(throttle_bps=None)
    text = "\n".join(line for _, line in lines)
    assert rc == 0, text[-5000:]

    # the driver-less rig's GPU fact is a normal answer, not a warning
    assert "will raise an exception in v4" not in text and "command not found" not in text, text[-5000:]
    # package installs say what they install
    driver = packages_for(NvidiaDriver(), "debian")  # the testbed rigs run Debian 13
    assert f"[rig1] installing {driver.pinning} (apt)" in text
    assert f"[rig1] installing {', '.join(driver.install)} (apt)" in text
    assert "[rig1] installing docker.io, docker-cli, docker-compose (apt)" in text
    assert "[rig1] installing nvidia-container-toolkit=1.19.0-1, nvidia-container-toolkit-base=1.19.0-1," in text
    # checkouts show their progress: what is fetched, git's own progress, the result
    for name in ("genesis", "vllm-src", "club-3090"):
        assert f"[rig1] rigforge: fetching {name} (" in text and f"[rig1] rigforge: {name} checked out at" in text
    assert re.search(r"\[rig1\] (remote: )?(Receiving objects|Updating files|Enumerating objects): .*100%", text)

    # every weight download: progress at least every 10 s, and a completion line with bytes and rate
    weights = [(t, line) for t, line in lines if "rigforge-weights: autoround-int4 model-0000" in line]
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for shard in shards:
        progress = [line for _, line in weights if shard in line and "(100%) downloaded in" not in line]
        done = [line for _, line in weights if shard in line and "(100%) downloaded in" in line]
        assert progress and re.search(
            rf"autoround-int4 {shard}: \d+\.\d KiB / 256\.1 KiB \(\d+%\) [\d.]+ KiB/s", progress[0]
        )
        assert len(done) == 1 and re.search(
            r"256\.1 KiB / 256\.1 KiB \(100%\) downloaded in [\d.]+ s, [\d.]+ KiB/s", done[0]
        )
    times = [t for t, _ in weights]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(weights) >= 6 and max(gaps) <= 10.0, list(zip(times, [line for _, line in weights], strict=True))

    rc, lines = run_timed(tb)  # converged: nothing to install, fetch or download, so nothing of that is said
    text = "\n".join(line for _, line in lines)
    assert rc == 0 and "[rig1] Success" not in text, text[-3000:]
    assert not re.search(r"installing |rigforge: fetching|rigforge-weights", text), text[-3000:]
