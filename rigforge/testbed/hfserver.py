"""A small Hugging Face Hub stand-in for huggingface_hub (HF_ENDPOINT=http://127.0.0.1:PORT). Stdlib only;
run as a script: `python hfserver.py --root DIR --port PORT`.

DIR holds one folder per repo (`<org>/<name>/`) with the files and a `.rigforge-meta.json`:
{"repo", "revision", "gated", "token", "files": [{"path", "size", "sha256", "git_oid", "lfs"}]}.

Routes (what huggingface_hub 2.x asks):
  GET  /api/models/{repo}[/revision/{rev}]               model info (sha, siblings)
  GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=  [{type, path, size, oid, lfs: {oid, size, pointerSize}}]
  HEAD|GET /{repo}/resolve/{rev}/{file}                   X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size,
                                                          Content-Length, Accept-Ranges; Range -> 206
  POST /_testbed/control  {"throttle_bps": N|null, "drop_after_bytes": N|null}   (drop: one-shot, next longer GET)
  GET  /_testbed/log      the last 500 requests: [{seq, method, path, range, status, auth}], seq counting from 1
A gated repo's downloads (resolve) answer 401 (no token) / 403 (other token) with X-Error-Code: GatedRepo; its
model info and file list are public (`gated: "manual"`), as the Hub serves them to anyone.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

META = ".rigforge-meta.json"
CONTROL = {"throttle_bps": None, "drop_after_bytes": None}
LOG: list[dict] = []
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rigforge-testbed-hf/1"
    root: Path

    def log_message(self, fmt: str, *args: object) -> None:  # quiet; /_testbed/log has the record
        pass

    # --- helpers -------------------------------------------------------------------------------------
    def _record(self, status: int) -> None:
        with LOCK:
            LOG.append(
                {
                    "seq": LOG[-1]["seq"] + 1 if LOG else 1,
                    "method": self.command,
                    "path": urlsplit(self.path).path,
                    "range": self.headers.get("Range"),
                    "status": status,
                    "auth": bool(self.headers.get("Authorization")),
                }
            )
            del LOG[:-500]

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, ctype: str = "application/json"
    ) -> None:
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: dict | list, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, code: str, message: str) -> None:
        self._json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, repo_id: str, rev: str | None, gate: bool = True) -> dict | None:
        """Return the repo meta, or None after answering with the Hub's error; `gate`: a gated repo asks for its
        token (downloads), else it answers anyone (model info, file lists)."""
        meta_path = self.root / repo_id / META
        if "/" not in repo_id or ".." in repo_id or not meta_path.is_file():
            self._error(401, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
            return None
        meta = json.loads(meta_path.read_text())
        if gate and meta.get("gated"):
            auth = self.headers.get("Authorization", "")
            if not auth:
                msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
                self._error(401, "GatedRepo", msg)
                return None
            if auth != f"Bearer {meta['token']}":
                msg = f"Access to model {repo_id} is restricted and you are not in the authorized list."
                self._error(403, "GatedRepo", msg)
                return None
        if rev is not None and rev not in ("main", meta["revision"]):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return meta

    # --- routes --------------------------------------------------------------------------------------
    def do_POST(self) -> None:
        if urlsplit(self.path).path != "/_testbed/control":
            return self._error(404, "EntryNotFound", "not found")
        body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
        with LOCK:
            CONTROL.update(json.loads(body or b"{}"))
            state = dict(CONTROL)
        self._json(state)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path == "/_testbed/log":
            with LOCK:
                log = list(LOG)
            return self._json(log)
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/") :])
        parts = path.strip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        self._error(404, "EntryNotFound", f"no route for {path}")

    def _api(self, rest: str) -> None:
        parts = rest.split("/")
        repo_id, tail = "/".join(parts[:2]), parts[2:]
        if not tail or tail[0] == "revision":
            meta = self._repo(repo_id, tail[1] if len(tail) > 1 else None, gate=False)
            if meta:
                siblings = [
                    {"rfilename": f["path"], "size": f["size"], "blobId": f["git_oid"]}
                    | ({"lfs": {"sha256": f["sha256"], "size": f["size"], "pointerSize": 134}} if f["lfs"] else {})
                    for f in meta["files"]
                ]
                self._json(
                    {
                        "_id": meta["revision"][:24],
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": meta["revision"],
                        "private": False,
                        "gated": "manual" if meta.get("gated") else False,
                        "disabled": False,
                        "lastModified": "2026-05-02T00:00:00.000Z",
                        "tags": [],
                        "downloads": 0,
                        "likes": 0,
                        "library_name": "transformers",
                        "siblings": siblings,
                        "usedStorage": sum(f["size"] for f in meta["files"]),
                    }
                )
            return
        if tail[0] == "tree" and len(tail) >= 2:
            meta = self._repo(repo_id, tail[1], gate=False)
            if not meta:
                return
            prefix = "/".join(tail[2:]).strip("/")
            recursive = "recursive=true" in (urlsplit(self.path).query or "").lower()
            entries, dirs = [], set()
            for f in meta["files"]:
                if prefix and not f["path"].startswith(prefix + "/"):
                    continue
                rel = f["path"][len(prefix) + 1 :] if prefix else f["path"]
                segs = rel.split("/")
                for i in range(1, len(segs)):
                    d = "/".join(([prefix] if prefix else []) + segs[:i])
                    if (recursive or i == 1) and d not in dirs:
                        dirs.add(d)
                        entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": d})
                if not recursive and len(segs) > 1:
                    continue
                entry = {"type": "file", "oid": f["git_oid"], "size": f["size"], "path": f["path"]}
                if f["lfs"]:
                    entry["lfs"] = {"oid": f["sha256"], "size": f["size"], "pointerSize": 134}
                entries.append(entry)
            return self._json(entries)
        self._error(404, "EntryNotFound", f"no route for /api/models/{rest}")

    def _resolve(self, repo_id: str, rev: str, filename: str) -> None:
        meta = self._repo(repo_id, rev)
        if not meta:
            return
        entry = next((f for f in meta["files"] if f["path"] == filename), None)
        if entry is None or ".." in filename:
            return self._error(404, "EntryNotFound", f"{filename} does not exist at {rev}")
        data_path = self.root / repo_id / filename
        size = entry["size"]
        etag = entry["sha256"] if entry["lfs"] else entry["git_oid"]
        headers = {
            "X-Repo-Commit": meta["revision"],
            "ETag": f'"{etag}"',
            "Accept-Ranges": "bytes",
            "Content-Disposition": f'inline; filename="{Path(filename).name}"',
        }
        if entry["lfs"]:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(size)
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes=") :].split(",")[0].partition("-")
            start = int(first) if first else max(size - int(last), 0)
            end = int(last) if first and last else size - 1
            if start >= size or end < start:
                self._record(416)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            end = min(end, size - 1)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = end - start + 1
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        with LOCK:
            bps = CONTROL["throttle_bps"]
            drop = CONTROL["drop_after_bytes"]
            if drop is not None and length > drop:
                CONTROL["drop_after_bytes"] = None  # one-shot: the next GET longer than `drop`
            else:
                drop = None
        sent = 0
        chunk = 16384 if not bps else max(1024, min(16384, int(bps) // 10))
        with open(data_path, "rb") as f:
            f.seek(start)
            while sent < length:
                n = min(chunk, length - sent)
                if drop is not None and sent + n > drop:
                    n = drop - sent
                    if n > 0:
                        self.wfile.write(f.read(n))
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # cut the transfer mid-file
                    return
                self.wfile.write(f.read(n))
                sent += n
                if bps:
                    time.sleep(n / float(bps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--port", required=True, type=int)
    args = parser.parse_args()
    Handler.root = args.root
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
