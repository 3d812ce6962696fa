"""The metrics on an opt-in HTTP port, loopback unless told otherwise: Prometheus text at
/metrics and the JSON snapshot at /status, served from a thread of their own."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from meshnet.core.metrics import prometheus_text


class MetricsServer:
    """GET /metrics: Prometheus text; GET /status: the JSON snapshot."""

    def __init__(self, snapshot: Callable[[], dict], port: int, host: str = "127.0.0.1"):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.startswith("/metrics"):
                    body, kind = prometheus_text(snapshot()).encode(), "text/plain; version=0.0.4"
                elif self.path.startswith("/status"):
                    body, kind = json.dumps(snapshot()).encode(), "application/json"
                else:
                    self.send_error(404, "try /metrics or /status")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="meshnet-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
