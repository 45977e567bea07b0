"""The smallest local HTTP server that speaks the Hugging Face Hub endpoints
huggingface_hub's `repo_exists`, `create_repo`, `create_branch` and `create_commit` use
(huggingface_hub 2.4: hf_api.py, _commit_api.py), plus /api/validate-yaml, which
`create_commit` calls before committing a README.md. `hf-local-hub` on PyPI needs a
separately downloaded server binary, so the tests use this instead.

Every file is stored as a regular blob (the preupload answer is "regular" for all, so
no LFS/Xet transfer is involved) under root/<owner>/<name>/<branch>/<path>. Writes
need `Authorization: Bearer <token>`; a missing repo answers 404 with
X-Error-Code: RepoNotFound, as the Hub does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


class HubHandler(BaseHTTPRequestHandler):
    server: LocalHub

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: dict | None = None, headers: dict | None = None):
        data = json.dumps(body or {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.server.token}":
            return True
        self._send(401, {"error": "Invalid credentials"}, {"X-Error-Code": "InvalidCredentials"})
        return False

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _repo_dir(self, repo: str) -> Path:
        return self.server.root / repo

    def do_GET(self):
        m = re.fullmatch(rf"/api/models/{REPO}(/revision/(?P<rev>[^/?]+))?(\?.*)?", self.path)
        if m:
            d = self._repo_dir(m["repo"])
            if not d.is_dir():
                return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            meta = json.loads((d / ".meta.json").read_text())
            branch = d / (m["rev"] or "main")
            files = sorted(p.relative_to(branch).as_posix() for p in branch.rglob("*") if p.is_file())
            return self._send(200, {"id": m["repo"], "modelId": m["repo"], "private": meta["private"],
                                    "sha": meta["heads"].get(m["rev"] or "main", "0" * 40),
                                    "siblings": [{"rfilename": f} for f in files]})
        self.server.unknown.append(f"{self.command} {self.path}")
        self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        if not self._authorized():
            return
        if self.path == "/api/repos/create":
            req = json.loads(self._body())
            repo = f"{req.get('organization') or self.server.user}/{req['name']}"
            d = self._repo_dir(repo)
            if d.is_dir():
                return self._send(409, {"error": "You already created this model repo", "url": self._url(repo)})
            (d / "main").mkdir(parents=True)
            private = req.get("visibility") == "private" or bool(req.get("private"))
            (d / ".meta.json").write_text(json.dumps({"private": private, "heads": {}}))
            return self._send(200, {"url": self._url(repo), "name": repo})
        if self.path == "/api/validate-yaml":  # create_commit checks a README's metadata first
            body = json.loads(self._body())
            ok = isinstance(body.get("content"), str) and body["content"].startswith("---")
            return self._send(200 if ok else 400, {"errors": [] if ok else [{"message": "no YAML front matter"}],
                                                   "warnings": []})
        m = re.fullmatch(rf"/api/models/{REPO}/preupload/(?P<rev>[^/?]+)(\?.*)?", self.path)
        if m:
            files = json.loads(self._body())["files"]
            return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        m = re.fullmatch(rf"/api/models/{REPO}/branch/(?P<rev>[^/?]+)", self.path)
        if m:
            (self._repo_dir(m["repo"]) / m["rev"]).mkdir(parents=True, exist_ok=True)
            return self._send(200, {})
        m = re.fullmatch(rf"/api/models/{REPO}/commit/(?P<rev>[^/?]+)(\?.*)?", self.path)
        if m:
            return self._commit(m["repo"], m["rev"])
        self.server.unknown.append(f"{self.command} {self.path}")
        self._send(404, {"error": f"no route {self.path}"})

    def _commit(self, repo: str, rev: str):
        d = self._repo_dir(repo)
        if not d.is_dir():
            return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        branch = d / rev
        branch.mkdir(exist_ok=True)
        h = hashlib.sha1()
        for line in self._body().splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                v = item["value"]
                if v.get("encoding") != "base64" or ".." in v["path"].split("/"):
                    return self._send(400, {"error": f"bad file entry {v.get('path')}"})
                dest = branch / v["path"]
                dest.parent.mkdir(parents=True, exist_ok=True)
                data = base64.b64decode(v["content"])
                dest.write_bytes(data)
                h.update(v["path"].encode() + data)
            elif item["key"] != "header":
                return self._send(400, {"error": f"unsupported commit entry {item['key']}"})
        meta = json.loads((d / ".meta.json").read_text())
        meta["heads"][rev] = h.hexdigest()
        (d / ".meta.json").write_text(json.dumps(meta))
        self.server.commits.append({"repo": repo, "revision": rev})
        return self._send(200, {"commitUrl": f"{self._url(repo)}/commit/{h.hexdigest()}",
                                "commitOid": h.hexdigest(), "pullRequestUrl": None})

    def _url(self, repo: str) -> str:
        return f"http://{self.server.server_address[0]}:{self.server.server_address[1]}/{repo}"


class LocalHub(ThreadingHTTPServer):
    def __init__(self, root: Path, token: str, user: str = "me"):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.root, self.token, self.user, self.commits, self.unknown = Path(root), token, user, [], []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
