"""A Hugging Face Hub on 127.0.0.1, for offline tests of what driftlab asks of the hub.

Why: downloads and the hub's refusals go through huggingface_hub's real client (repo info,
tree listing, per-file metadata and download), so driftlab's handling is tested against the
protocol, not a mock of its own functions. Serves the repos in `FakeHub.repos` (id -> (commit,
local directory)); answers a gated, a missing repo and a missing revision as the hub does
(status + X-Error-Code); anything else is a 500.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub(http.server.BaseHTTPRequestHandler):
    repos: dict[str, tuple[str, Path]] = {}
    gated: set[str] = set()  # served repos whose files need an accepted licence (the hub's metadata stays public)
    requests: list[str] = []

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
               code: str = "") -> None:
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        path = unquote(urlparse(self.path).path)
        self.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        api = parts[0] == "api"
        if api and (parts[1] != "models" or len(parts) < 4):
            return self._reply(404, b"{}")  # other APIs the client may try (they are optional)
        repo = "/".join(parts[2:4] if api else parts[0:2])
        if repo.startswith("gated-org/"):
            return self._reply(401, b"{}", code="GatedRepo")
        if repo not in self.repos:
            if repo.startswith("missing-org/"):
                return self._reply(404, b"{}", code="RepoNotFound")
            return self._reply(500, b"{}")
        sha, root = self.repos[repo]
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        if api and (len(parts) == 4 or parts[4] == "revision"):
            if len(parts) > 5 and parts[5] not in ("main", sha):
                return self._reply(404, b"{}", code="RevisionNotFound")
            body = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
            return self._reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        if api and parts[4] == "tree":
            body = [{"type": "file", "path": f, "size": (root / f).stat().st_size,
                     "oid": hashlib.sha1((root / f).read_bytes()).hexdigest()} for f in files]
            return self._reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        if not api and repo in self.gated:
            return self._reply(401, b"{}", code="GatedRepo")
        if not api and parts[2] == "resolve" and parts[3] in ("main", sha):
            file = root / "/".join(parts[4:])
            if not file.is_file():
                return self._reply(404, b"{}", code="EntryNotFound")
            data = file.read_bytes()
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            return self._reply(200, data, {"X-Repo-Commit": sha, "ETag": etag,
                                           "Content-Type": "application/octet-stream"})
        return self._reply(404, b"{}", code="RevisionNotFound")

    def log_message(self, *args) -> None:
        pass


@contextmanager
def fake_hub(repos: dict[str, tuple[str, Path]] | None = None, gated: set[str] | None = None) -> Iterator[str]:
    """Serve `repos` (of which `gated` only to the licensed) until the block ends; yields the
    endpoint (for HF_ENDPOINT)."""
    FakeHub.repos, FakeHub.gated, FakeHub.requests = dict(repos or {}), set(gated or ()), []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
