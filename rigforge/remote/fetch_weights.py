#!/usr/bin/env python3
"""Fetch one locked Hugging Face asset into a model directory, verified. Shipped to rigs by roles/weights.py.

Runs on the rig (venv python with huggingface_hub) or on the controller (`weights_source: controller` cache).
Input: a JSON manifest (--manifest FILE, or stdin) with
  {"name", "repo", "revision", "endpoint", "dest", "staging", "stamp", "files": [{"path", "size", "sha256"}]}
and the token in a root-only file (--token-file), never on the command line.

Per file: a file at <dest> whose stamp entry matches its size+mtime and the lock's sha256 is kept without
reading it (--deep re-hashes everything). Anything else is (re)fetched into <staging>/<path>.<sha256[:16]>.part
with HTTP Range resume (huggingface_hub resolves URL, auth and the pinned commit; bytes already fetched are kept
across interruptions), verified against the lock's size + sha256 (one re-fetch on a mismatch, then exit 4 naming
the file), and only then moved into place with os.replace. A bad file never sits at the final path. The stamp
<stamp> (the layout's stamp file in <dest>) records size, mtime_ns and sha256 per file.
--staged-only: the files were pushed into <staging>/<path> by the controller: verify and move, no hub access.
Exit codes: 0 ok, 2 bad input, 3 not enough disk space, 4 verification failed, 5 download failed.
"""

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of hashlib's hash objects, named by typeshed only
    from hashlib import _Hash

HEADROOM = 1.05
CHUNK = 1 << 20
RETRIES = 3
PROGRESS_EVERY = 5.0  # seconds between progress lines while a file transfers (also while it stalls)


class Interrupted(Exception):
    """The transfer stopped early; the bytes so far stay in the .part file for the next attempt."""


class Fail(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


def say(msg: str) -> None:
    print(f"rigforge-weights: {msg}", flush=True)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


class Progress:
    """While a transfer runs, a line every PROGRESS_EVERY s (even when no byte arrives): asset and file, bytes
    done / total, percent, current rate; leaving it with every byte in prints the completion line (average rate)."""

    def __init__(self, label: str, total: int, have: int) -> None:
        self.label = label
        self.total = total
        self.have = have
        self.done = have
        self.last_done = have
        self.t0 = self.last_t = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None and self.done >= self.total:
            secs = time.monotonic() - self.t0
            rate = human((self.done - self.have) / max(secs, 1e-6))
            say(f"{self.label}: {human(self.done)} / {human(self.total)} (100%) downloaded in {secs:.1f} s, {rate}/s")

    def _beat(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY):
            now, done = time.monotonic(), self.done
            rate = (done - self.last_done) / max(now - self.last_t, 1e-6)
            self.last_t, self.last_done = now, done
            pct = 100 * done / self.total if self.total else 100
            say(f"{self.label}: {human(done)} / {human(self.total)} ({pct:.0f}%) {human(rate)}/s")


def hash_file(path: str) -> "_Hash":
    """A sha256 of the file's bytes, read in CHUNKs: .hexdigest() for the hex, .update() to hash more after it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest


def stamp_entry(path: str, sha256: str) -> dict:
    """What the stamp records for a verified file: its size and mtime now, and the lock's sha256."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def load_stamp(path: str) -> dict:
    """The stamp at `path` as write_stamp wrote it ({"version", "repo", "revision", "files"}); {"files": {}} when
    it is missing, unreadable or not a stamp (a file already in place is then hashed, not trusted)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {"files": {}}
    if isinstance(data, dict) and isinstance(data.get("files"), dict):
        return data
    return {"files": {}}


def write_stamp(m: dict, entries: dict) -> None:
    data = {"version": 1, "repo": m["repo"], "revision": m["revision"], "files": entries}
    tmp = f"{m['stamp']}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, m["stamp"])


def part_path(m: dict, f: dict) -> str:
    """Partial download of this exact file version (a new lock sha256 never resumes an old part)."""
    return os.path.join(m["staging"], f"{f['path']}.{f['sha256'][:16]}.part")


def current(m: dict, f: dict, stamp: dict, deep: bool) -> dict | None:
    """The stamp entry for a good file at its final path, or None (and the bad file removed)."""
    final = os.path.join(m["dest"], f["path"])
    try:
        entry = stamp_entry(final, f["sha256"])
    except FileNotFoundError:
        return None
    if not deep and stamp.get(f["path"]) == entry and entry["size"] == f["size"]:
        return entry
    if entry["size"] == f["size"]:
        how = "deep verify, hashing {}" if deep else "hashing {} (not stamped or changed since)"
        say(f"{f['path']}: " + how.format(human(f["size"])))
        if hash_file(final).hexdigest() == f["sha256"]:
            return entry
    say(f"{f['path']}: does not match the lock (size or sha256): removed, will fetch it again")
    os.unlink(final)
    return None


def download(m: dict, f: dict, part: str, token: str | None) -> str:
    """GET the pinned file into `part`, resumed from its length (HTTP Range); its sha256, hashed as it streams."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(m["repo"], f["path"], revision=m["revision"], endpoint=m.get("endpoint") or None)
    try:
        meta = get_hf_file_metadata(url, token=token or False)
    except Exception as e:  # noqa: BLE001 - report hub errors (gated, 404, network) by name
        raise Fail(5, f"{f['path']}: cannot resolve {m['repo']}@{m['revision']}: {type(e).__name__}: {e}") from None
    if meta.commit_hash and meta.commit_hash != m["revision"]:
        raise Fail(5, f"{f['path']}: hub served commit {meta.commit_hash}, lock pins {m['revision']}")
    headers = build_hf_headers(token=token or False)
    if urllib.parse.urlsplit(meta.location).netloc != urllib.parse.urlsplit(url).netloc:  # presigned CDN URL:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}  # keep the token on the hub
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > f["size"]:
        os.unlink(part)
        have = 0
    if have == f["size"]:
        return hash_file(part).hexdigest()
    if have:
        headers["Range"] = f"bytes={have}-"
        say(f"{f['path']}: resuming at {human(have)} of {human(f['size'])}")
    try:
        resp = urllib.request.urlopen(urllib.request.Request(meta.location, headers=headers), timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:
            os.unlink(part)
            return download(m, f, part, token)
        raise Fail(5, f"{f['path']}: download failed: HTTP {e.code}") from None
    except OSError as e:
        raise Fail(5, f"{f['path']}: download failed: {e}") from None
    with resp:
        if have and resp.status != 206:
            say(f"{f['path']}: server ignored the Range request, starting over")
            have = 0
        digest = hash_file(part) if have else hashlib.sha256()  # the bytes kept, then the rest as it streams
        label = f"{m.get('name') or m['repo']} {f['path']}"
        with open(part, "ab" if have else "wb", buffering=0) as out, Progress(label, f["size"], have) as progress:
            try:  # unbuffered: a kill loses at most one chunk
                while chunk := resp.read1(CHUNK):  # what has arrived, not a blocking full CHUNK
                    out.write(chunk)
                    digest.update(chunk)
                    progress.done += len(chunk)  # read by the progress thread
            except (OSError, http.client.HTTPException) as e:
                raise Interrupted(f"{f['path']}: transfer interrupted at {human(progress.done)}: {e}") from None
            finally:
                os.fsync(out.fileno())
    if progress.done < f["size"]:
        raise Interrupted(f"{f['path']}: transfer ended early at {human(progress.done)} of {human(f['size'])}")
    return digest.hexdigest()


def fetch_one(m: dict, f: dict, token: str | None, staged_only: bool) -> dict:
    """Fetch (or, staged_only, take from staging) one file, verify it and move it into place; its stamp entry."""
    staged = os.path.join(m["staging"], f["path"]) if staged_only else part_path(m, f)
    os.makedirs(os.path.dirname(staged), exist_ok=True)
    for attempt in (1, 2):
        digest = None
        for retry in range(RETRIES + 1) if not staged_only else ():
            try:
                digest = download(m, f, staged, token)
                break
            except Interrupted as e:
                if retry == RETRIES:
                    raise Fail(5, f"{e}; re-run to resume") from None
                say(f"{e}; retrying (resumes where it stopped)")
                time.sleep(1)
        if not os.path.exists(staged):
            raise Fail(4, f"{f['path']}: not found in staging {m['staging']}")
        size, digest = os.path.getsize(staged), digest or hash_file(staged).hexdigest()
        if size == f["size"] and digest == f["sha256"]:
            final = os.path.join(m["dest"], f["path"])
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(staged, final)
            say(f"{m['name']} {f['path']}: sha256 verified, in place")
            return stamp_entry(final, f["sha256"])
        os.unlink(staged)
        what = f"size {size} / sha256 {digest}, lock says size {f['size']} / sha256 {f['sha256']}"
        if staged_only or attempt == 2:
            raise Fail(4, f"{f['path']}: verification failed ({what}); the file was removed, not used")
        say(f"{f['path']}: verification failed ({what}); fetching it again")


def run(m: dict, token: str | None, deep: bool, staged_only: bool) -> int:
    for key in ("repo", "revision", "dest", "staging", "stamp", "files"):
        if not m.get(key):
            raise Fail(2, f"manifest lacks '{key}'")
    os.makedirs(m["dest"], exist_ok=True)
    stamp_data = load_stamp(m["stamp"])
    stamp = stamp_data["files"] if stamp_data.get("revision") == m["revision"] else {}  # another revision's: none
    found = [(f, current(m, f, stamp, deep)) for f in m["files"]]
    entries = {f["path"]: entry for f, entry in found if entry}
    missing = [f for f, entry in found if not entry]
    write_stamp(m, entries)
    if not missing:
        tidy_staging(m)
        say(f"{m['name']}: all {len(entries)} files verified ({'deep' if deep else 'stamp'})")
        return 0
    if m.get("gated") and not token and not staged_only:  # a stamped gated asset needs no token
        raise Fail(2, f"{m['repo']} is gated: set host data hf_token (or RIGFORGE_HF_TOKEN / HF_TOKEN)")
    if not staged_only:
        partial = sum(min(os.path.getsize(p), f["size"]) for f in missing if os.path.exists(p := part_path(m, f)))
        need = int((sum(f["size"] for f in missing) - partial) * HEADROOM)
        free = shutil.disk_usage(m["dest"]).free  # dest exists: made above
        if need > free:
            raise Fail(
                3,
                f"not enough disk space at {m['dest']}: {len(missing)} files to fetch need {human(need)} "
                f"(missing bytes + 5%), {human(free)} free; free space or set weights_model_dir",
            )
    say(f"{m['name']}: fetching {len(missing)} of {len(m['files'])} files from {m['repo']}@{m['revision'][:12]}")
    for f in missing:
        entries[f["path"]] = fetch_one(m, f, token, staged_only)
        write_stamp(m, entries)
    tidy_staging(m)
    say(f"{m['name']}: all {len(entries)} files verified")
    return 0


def tidy_staging(m: dict) -> None:
    """All files are in place: drop the staging dir (parts of old revisions, empty dirs), so nothing is left."""
    for root, _dirs, names in os.walk(m["staging"], topdown=False):
        for name in names:
            if name.endswith(".part"):
                os.unlink(os.path.join(root, name))
        with contextlib.suppress(OSError):
            os.rmdir(root)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", help="manifest JSON file (default: stdin)")
    p.add_argument("--token-file", help="file holding the HF token (mode 0600)")
    p.add_argument("--deep", action="store_true", help="re-hash every file instead of trusting the stamp")
    p.add_argument("--staged-only", action="store_true", help="verify files pushed into staging; no hub access")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        m = json.loads(Path(a.manifest).read_text()) if a.manifest else json.load(sys.stdin)
        has_token = a.token_file and os.path.exists(a.token_file)
        token = (Path(a.token_file).read_text().strip() or None) if has_token else None
        m.setdefault("name", m.get("repo", "?"))
        return run(m, token, a.deep, a.staged_only)
    except (Fail, OSError, ValueError) as e:
        print(f"rigforge-weights: ERROR: {e}", file=sys.stderr, flush=True)
        return e.code if isinstance(e, Fail) else 2


if __name__ == "__main__":
    sys.exit(main())
