"""A Hugging Face hub of our own on loopback, for tests that must not reach the internet:
it answers the paths huggingface_hub asks (`/api/models/REPO[/revision/REV]` with each
file's LFS sha256, and `HEAD`/`GET /REPO/resolve/REV/FILE` with ranges) for the files a
test gives it, and can cut a file's responses short (a download that stops, as a
connection drops), hold one mid-file until it is closed (a download its process is killed
in), or serve it with bytes changed (a corrupt download). Point HF_ENDPOINT at `hub.endpoint`."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self, repo: str, files: dict[str, bytes]):
        self.repo, self.files = repo, files
        self.cuts: dict[str, list[int]] = {}   # a file's next GETs stop after these many bytes, one each
        self.stalls: dict[str, int] = {}    # a file's GETs send this many bytes, then wait for close()
        self.closing = threading.Event()
        self.corrupt: set[str] = set()      # files served with a byte flipped (the API keeps the true sha256)
        self.requests: list[tuple[str, str, str | None]] = []   # (method, path, Range)
        self.served: dict[str, int] = {}    # bytes of each file sent
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        if re.fullmatch(rf"/api/models/{re.escape(self.repo)}(/revision/[^/]+)?", path):
            info = {"id": self.repo, "sha": COMMIT, "siblings": [
                {"rfilename": name, "size": len(data),
                 "lfs": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}}
                for name, data in self.files.items()]}
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        m = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/[^/]+/(.+)", path)
        if not m or m[1] not in self.files:
            return self._send(h, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)
        name, data = m[1], self.files[m[1]]
        if name in self.corrupt:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(self.files[name]).hexdigest()}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start = 0
        if (r := h.headers.get("Range")) and (rm := re.fullmatch(r"bytes=(\d+)-", r)):
            start = int(rm[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        stall = self.stalls.get(name)
        if body and (self.cuts.get(name) or stall is not None):
            sent = part[:self.cuts[name].pop(0) if self.cuts.get(name) else stall]
            h.send_response(206 if start else 200)
            for k, v in {**headers, "Content-Length": str(len(part))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(sent)
            h.wfile.flush()
            self.served[name] = self.served.get(name, 0) + len(sent)
            if stall is not None:
                self.closing.wait()
            h.close_connection = True
            h.connection.shutdown(2)   # the connection drops mid-file
            return
        if body:
            self.served[name] = self.served.get(name, 0) + len(part)
        self._send(h, 206 if start else 200, part, headers, body)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict, body: bool) -> None:
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def close(self) -> None:
        self.closing.set()
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join()
