"""An HTTP client of one SGLang server's native API, with the request and response shapes of SGLang 0.5.23.

One method per endpoint the trainer uses; each sends the body SGLang's FastAPI handler parses
(`sglang/srt/managers/io_struct.py`) and reads what the handler answers
(`sglang/srt/entrypoints/http_server.py`): `{"success", "message"}` with 200 or 400 for the
weight calls, `null` for release/resume, text for flush_cache, a list of
`{"output_ids", "meta_info": {"output_token_logprobs": [[logprob, token_id, text], ...]}}` for a
batch /generate. Every failure becomes a `RolloutServerError` naming the server, the call and
the reason. Calls that are safe to repeat are retried under a bounded `RetryPolicy` when the
connection fails or the server answers 502/503/504; the weight-update calls, which move a
collective forward, are never repeated. Depends on the standard library only.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"
RETRY_STATUSES = (502, 503, 504)


class RolloutServerError(RuntimeError):
    """A call to a rollout server failed; says which server, which call, how often it was tried, and why."""

    def __init__(self, *, server: str, call: str, reason: str, attempts: int = 1, status: int | None = None):
        self.server, self.call, self.reason, self.attempts, self.status = server, call, reason, attempts, status
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"rollout server {server}: {call} failed{tries}: {reason}")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3
    """Tries of a repeatable call in all (1 = no retry)."""
    backoff_s: float = 0.5
    """Wait before the second try; doubled before each further one."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0:
            raise ValueError(f"RetryPolicy.backoff_s must be >= 0, got {self.backoff_s}")


DEFAULT_RETRY = RetryPolicy()


class _Transient(Exception):
    """A failure worth another try: no connection, or 502/503/504."""


class SGLangClient:
    """The native API of one server at `url` (e.g. http://10.0.0.5:30000).

    `describe_death`, when given, is asked after a connection failure whether the server's
    process is gone (it returns e.g. "process exited with code -9; last log lines: ...") so
    the error carries the cause, not just "connection refused".
    """

    def __init__(
        self,
        url: str,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout_s: float = 600.0,
        describe_death: Callable[[], str | None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry
        self.timeout_s = timeout_s
        self.describe_death = describe_death

    # --- health and identity -------------------------------------------------------------------

    def health(self, *, timeout_s: float = 5.0) -> bool:
        """GET /health: whether the server answers 200 now (one try, no error on failure)."""
        try:
            status, _ = self._send("GET", "/health", None, timeout_s=timeout_s)
        except _Transient:
            return False
        return status == 200

    def model_info(self) -> dict[str, Any]:
        """GET /model_info: model_path, tokenizer_path, is_generation, weight_version, ..."""
        return self._call("GET", "/model_info", None, repeatable=True)

    # --- generation ----------------------------------------------------------------------------

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """POST /generate for a batch of token-id prompts, with the sampled tokens' log-probs.

        Returns one `{"output_ids": [...], "meta_info": {...}}` per prompt, in order.
        """
        answer = self._call("POST", "/generate", _generate_body(input_ids, sampling_params), repeatable=True)
        if not isinstance(answer, list) or len(answer) != len(input_ids):
            got = f"{len(answer)} results" if isinstance(answer, list) else type(answer).__name__
            raise RolloutServerError(
                server=self.url, call="/generate", reason=f"expected a list of {len(input_ids)} results, got {got}"
            )
        return answer

    def generate_one(self, input_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        """POST /generate for one prompt: the form sglang_router 0.3.2 balances (it refuses a list
        of sampling_params, and sends a whole batch to one worker)."""
        answer = self._call("POST", "/generate", _generate_body(input_ids, sampling_params), repeatable=True)
        if not isinstance(answer, dict):
            raise RolloutServerError(
                server=self.url, call="/generate", reason=f"expected one result object, got {type(answer).__name__}"
            )
        return answer

    def pause_generation(self, *, mode: str = "abort") -> None:
        """POST /pause_generation: stop taking new work ('abort' also aborts what is running)."""
        self._call("POST", "/pause_generation", {"mode": mode}, repeatable=True)

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {}, repeatable=True)

    def flush_cache(self) -> None:
        """POST /flush_cache: drop the prefix (radix) cache, whose entries were computed by old weights."""
        self._call("POST", "/flush_cache", None, repeatable=True)

    # --- memory --------------------------------------------------------------------------------

    def release_memory_occupation(self, *, tags: list[str] | None = None) -> None:
        """POST /release_memory_occupation; tags among 'weights', 'kv_cache', 'cuda_graph' (None = all)."""
        self._call("POST", "/release_memory_occupation", {"tags": tags}, repeatable=False)

    def resume_memory_occupation(self, *, tags: list[str] | None = None) -> None:
        self._call("POST", "/resume_memory_occupation", {"tags": tags}, repeatable=False)

    # --- weights -------------------------------------------------------------------------------

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> None:
        """POST /init_weights_update_group: the server's TP ranks join the group as ranks
        rank_offset .. rank_offset + tp - 1; it answers once every rank has joined."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._call("POST", "/init_weights_update_group", body, repeatable=False, timeout_s=timeout_s)

    def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> None:
        """POST /update_weights_from_distributed: receive one bucket, one broadcast per tensor from
        rank 0 in the order named, and load it. Dtypes are torch names without 'torch.'."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        self._call("POST", "/update_weights_from_distributed", body, repeatable=False)

    def update_weights_from_tensor(
        self,
        *,
        serialized_named_tensors: list[str],
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """POST /update_weights_from_tensor (colocated): one base64 payload per TP rank."""
        body = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": None,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        self._call("POST", "/update_weights_from_tensor", body, repeatable=False)

    def destroy_weights_update_group(self, *, group_name: str = DEFAULT_GROUP) -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name}, repeatable=False)

    # --- plumbing ------------------------------------------------------------------------------

    def _call(
        self, method: str, path: str, body: dict | None, *, repeatable: bool, timeout_s: float | None = None
    ) -> Any:
        attempts = self.retry.attempts if repeatable else 1
        delay, attempt = self.retry.backoff_s, 1
        while True:
            try:
                status, payload = self._send(method, path, body, timeout_s=timeout_s or self.timeout_s)
            except _Transient as exc:
                if attempt >= attempts:
                    raise RolloutServerError(
                        server=self.url, call=path, reason=self._with_cause(str(exc)), attempts=attempt
                    ) from None
                logger.warning("rollout server %s: %s failed (%s); try %d of %d", self.url, path, exc, attempt + 1, attempts)
                time.sleep(delay)
                delay, attempt = delay * 2, attempt + 1
                continue
            return self._read(path, status, payload)

    def _send(self, method: str, path: str, body: dict | None, *, timeout_s: float) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                status, raw, kind = response.status, response.read(), response.headers.get_content_type()
        except urllib.error.HTTPError as error:
            status, raw, kind = error.code, error.read(), error.headers.get_content_type()
        except TimeoutError:
            raise RolloutServerError(server=self.url, call=path, reason=f"no answer within {timeout_s:.0f}s") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError) as error:
            reason = getattr(error, "reason", None) or error
            raise _Transient(f"connection failed: {reason}") from None
        payload = json.loads(raw) if kind == "application/json" and raw else raw.decode(errors="replace")
        if status in RETRY_STATUSES:
            raise _Transient(f"HTTP {status}: {_message(payload)}")
        return status, payload

    def _read(self, path: str, status: int, payload: Any) -> Any:
        if status == 200:
            if isinstance(payload, dict) and payload.get("success") is False:
                raise RolloutServerError(server=self.url, call=path, reason=_message(payload), status=status)
            return payload
        if status == 404:
            reason = "HTTP 404 (no such endpoint: is this an SGLang 0.5.23-compatible server?)"
        else:
            reason = f"HTTP {status}: {_message(payload)}"
        raise RolloutServerError(server=self.url, call=path, reason=reason, status=status)

    def _with_cause(self, reason: str) -> str:
        death = self.describe_death() if self.describe_death else None
        return f"{reason}; {death}" if death else reason


def _message(payload: Any) -> str:
    """The human part of an SGLang error body, whichever of its shapes it has."""
    if isinstance(payload, dict):
        if "message" in payload:
            return str(payload["message"])
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if error is not None:
            return str(error)
        if "detail" in payload:
            return json.dumps(payload["detail"])
    return str(payload).strip()[:500]


def _generate_body(input_ids: list[int] | list[list[int]], sampling_params: Any) -> dict[str, Any]:
    """/generate's body: token ids in, the sampled tokens' log-probs out, no streaming."""
    return {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
