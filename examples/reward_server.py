"""A scoring endpoint for `reward.type: Remote`, standard library only: each response's score is the
share of its characters that are "a" (the synthetic task, so builtin:tiny learns it).

    python examples/reward_server.py 8000    # then reward.remote.url: http://<this host>:8000/score
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Scorer(BaseHTTPRequestHandler):
    def do_POST(self):
        batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        scores = [r.count("a") / len(r) if r else 0.0 for r in batch["responses"]]  # batch["prompts"], ["labels"] too
        body = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    ThreadingHTTPServer(("", int(sys.argv[1]) if len(sys.argv) > 1 else 8000), Scorer).serve_forever()
