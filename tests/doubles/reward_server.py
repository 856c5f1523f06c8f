"""A scoring endpoint for the tests of `reward.type: Remote`: a real HTTP server (standard library)
speaking the protocol of docs/trainer.md, scripted to answer well or to misbehave, and counting
what it sees (`GET /stats`).

In a thread: `with serve(Script(...)) as server: ... server.url ... server.stats()`. As a process:
`python -m tests.doubles.reward_server --answer nan`, which prints its URL on its first line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ANSWERS = ("fraction", "nan", "short", "refuse")


@dataclass(frozen=True)
class Script:
    answer: str = "fraction"
    """fraction: each score is the share of the response's characters in `target`; nan: the same with
    the last score of each request NaN; short: one score fewer than samples; refuse: HTTP 400."""
    failures: int = 0
    """The first `failures` requests are answered `failure_status`, whatever `answer` says."""
    failure_status: int = 503
    delay_seconds: float = 0.0
    """Wait before answering each request."""
    target: str = "a"


def fraction(response: str, target: str) -> float:
    return sum(ch in target for ch in response) / len(response) if response else 0.0


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: Script, *, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.script = script
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = {"requests": 0, "samples": 0, "score_sum": 0.0, "in_flight": 0,
                                       "max_in_flight": 0, "batch_sizes": [], "authorization": None}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that stopped waiting (timed out): expected
            super().handle_error(request, client_address)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._stats))

    def answer(self, body: dict[str, Any], authorization: str | None) -> tuple[int, str]:
        script, stats = self.script, self._stats
        responses = body["responses"]
        if not len(body["prompts"]) == len(body["labels"]) == len(responses):
            return 400, "prompts, responses and labels differ in length"
        with self._lock:
            stats["requests"] += 1
            number = stats["requests"]
            stats["in_flight"] += 1
            stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
            stats["batch_sizes"].append(len(responses))
            stats["authorization"] = authorization
        try:
            time.sleep(script.delay_seconds)
            if number <= script.failures:
                return script.failure_status, "warming up, try again"
            if script.answer == "refuse":
                return 400, "this scorer refuses\nthe batch: labels must be numbers"
            scores = [fraction(r, script.target) for r in responses]
            with self._lock:
                stats["samples"] += len(scores)
                stats["score_sum"] += sum(scores)
            if script.answer == "nan":
                scores[-1] = float("nan")
            elif script.answer == "short":
                scores.pop()
            return 200, json.dumps({"scores": scores})
        finally:
            with self._lock:
                stats["in_flight"] -= 1


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(*self.server.answer(body, self.headers.get("Authorization")))

    def do_GET(self) -> None:
        self._send(200, json.dumps(self.server.stats()))

    def _send(self, status: int, text: str) -> None:
        payload = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests read /stats


@contextmanager
def serve(script: Script) -> Iterator[RewardServer]:
    """The server, answering from a thread of this process until the block ends."""
    server = RewardServer(script)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answer", choices=ANSWERS, default="fraction")
    parser.add_argument("--failures", type=int, default=0)
    parser.add_argument("--failure-status", type=int, default=503)
    parser.add_argument("--delay-seconds", type=float, default=0.0)
    parser.add_argument("--target", default="a")
    args = parser.parse_args(argv)
    server = RewardServer(Script(answer=args.answer, failures=args.failures, failure_status=args.failure_status,
                                 delay_seconds=args.delay_seconds, target=args.target))
    print(server.url, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
