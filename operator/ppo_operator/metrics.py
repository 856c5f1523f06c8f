"""A Prometheus text endpoint of the operator's own API requests (`--metrics-port`).

Serves `ppojob_operator_api_requests_total{verb,resource}` from `Kube.counts` on /metrics from a
daemon thread. Depends on the standard library only.
"""

from __future__ import annotations

import collections
import http.server
import threading


def render(counts: collections.Counter[str]) -> str:
    lines = [
        "# HELP ppojob_operator_api_requests_total API requests the reconcile made, by verb and resource.",
        "# TYPE ppojob_operator_api_requests_total counter",
    ]
    for key, value in sorted(counts.items()):
        verb, _, resource = key.partition(" ")
        lines.append(f'ppojob_operator_api_requests_total{{verb="{verb}",resource="{resource}"}} {value}')
    return "\n".join(lines) + "\n"


def serve(port: int, counts: collections.Counter[str], host: str = "0.0.0.0") -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = render(counts).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            return

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
