"""Reward functions: a sequence score per (prompt, response, label), behind one small interface.

``Reward.score(prompts, responses, labels) -> list[float]`` is the whole contract. Rewards here
are plain Python over strings (``RemoteReward`` sends them to an HTTP endpoint with the standard
library): nothing may depend on Ray, models, tokenizers or configuration objects.
``build_reward`` maps a kind name and its options to an instance. A reward model's score, which
needs torch and transformers, is a `Reward` of its own room (`reward_model.ModelReward`).
"""

from __future__ import annotations

import dataclasses
import http.client
import inspect
import json
import math
import numbers
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ppo_trainer.algorithms.custom_advantage import FunctionReferenceError, describe_function, load_function

__all__ = [
    "REWARD_KINDS",
    "CustomReward",
    "CustomRewardError",
    "ExactFinalAnswerReward",
    "RemoteReward",
    "RemoteRewardError",
    "Reward",
    "SyntheticReward",
    "build_reward",
    "extract_final_answer",
]


class CustomRewardError(ValueError):
    """A custom reward function could not be loaded, failed, or returned a bad output."""


class RemoteRewardError(ValueError):
    """A reward endpoint's settings are wrong, or it could not be reached, or it answered something
    other than one finite score per sample."""


class Reward(ABC):
    """Scores responses: one float per (prompt, response, label), in order."""

    @abstractmethod
    def score(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        """Return one finite score per response."""

    @staticmethod
    def _check_lengths(prompts: Sequence[Any], responses: Sequence[Any], labels: Sequence[Any]) -> None:
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(
                f"prompts, responses and labels must have the same length; got {len(prompts)}, "
                f"{len(responses)} and {len(labels)}"
            )


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: no answer


def extract_final_answer(text: str) -> str:
    """The final answer in ``text``: the last ``\\boxed{}``, else what follows the last ``####``,
    else the last number, else the whole text; stripped of spaces, ``$`` and a trailing period."""
    answer = _last_boxed(text)
    if answer is None and "####" in text:
        answer = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    if answer is None:
        numbers_found = _NUMBER.findall(text)
        answer = numbers_found[-1] if numbers_found else text
    return answer.strip().strip("$").strip().rstrip(".").strip()


def _normalize(answer: str) -> str | float:
    """A number when the answer reads as one (``1,000`` and ``1000.0`` -> 1000.0), else casefolded text."""
    candidate = answer.replace(",", "").replace(" ", "")
    try:
        return float(candidate)
    except ValueError:
        return " ".join(answer.split()).casefold()


@dataclass(frozen=True)
class ExactFinalAnswerReward(Reward):
    """1.0 when the response's final answer equals the label's, else 0.0.

    The final answer is the last ``\\boxed{}``, else the text after the last ``####``, else the
    last number (see ``extract_final_answer``); the label goes through the same extraction, so a
    GSM8K-style label ``"... #### 72"`` works as well as ``"72"``. Numbers compare by value.
    """

    correct: float = 1.0
    """Score of a correct answer."""
    incorrect: float = 0.0
    """Score of a wrong or missing answer."""

    def score(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        self._check_lengths(prompts, responses, labels)
        scores = []
        for i, (response, label) in enumerate(zip(responses, labels)):
            if label is None:
                raise ValueError(
                    f"ExactFinalAnswerReward needs a label for every prompt; labels[{i}] is None "
                    f"(set label_key to the field holding the answer, or use another reward)"
                )
            match = _normalize(extract_final_answer(response)) == _normalize(extract_final_answer(label))
            scores.append(self.correct if match else self.incorrect)
        return scores


@dataclass(frozen=True)
class SyntheticReward(Reward):
    """Fraction of the response's characters that are in ``target``; 0.0 for an empty response.

    A dense reward a tiny randomly initialised byte-level model can learn on a CPU: at random
    init about ``len(target) / 256`` of the bytes hit, and every extra hit raises the reward.
    Labels are ignored.
    """

    target: str = "a"
    """The characters that count as hits (each one; e.g. ``"a"`` or ``"aeiou"``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"SyntheticReward target must be a non-empty string, got {self.target!r}")

    def score(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        self._check_lengths(prompts, responses, labels)
        hits = set(self.target)
        return [sum(ch in hits for ch in r) / len(r) if r else 0.0 for r in responses]


@dataclass(frozen=True)
class CustomReward(Reward):
    """A user's ``fn(prompts, responses, labels) -> list[float]``, with its output checked.

    Built from a ``"package.module:function"`` or ``"/path/to/file.py:function"`` reference
    (``CustomReward.load``). The output must be a list or tuple of finite real numbers, one per
    response; anything else raises ``CustomRewardError`` naming the function.
    """

    fn: Callable[[list[str], list[str], list[str | None]], Sequence[float]]

    @classmethod
    def load(cls, ref: str) -> CustomReward:
        """The function of `ref`, imported and checked to take (prompts, responses, labels)."""
        try:
            fn = load_function(ref)
        except FunctionReferenceError as exc:
            raise CustomRewardError(f"custom reward function {exc}") from exc
        try:
            inspect.signature(fn.fn).bind([], [], [])
        except TypeError as exc:
            raise CustomRewardError(
                f"custom reward function {ref!r} cannot be called as fn(prompts, responses, labels) ({exc});"
                f" give it those three parameters"
            ) from None
        except ValueError:
            pass  # no signature to read (some builtins): the call itself will tell
        return cls(fn=fn)

    def score(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        self._check_lengths(prompts, responses, labels)
        name = describe_function(self.fn)
        try:
            out = self.fn(list(prompts), list(responses), list(labels))
        except Exception as exc:
            raise CustomRewardError(f"{name} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, (list, tuple)):
            raise CustomRewardError(f"{name} returned {type(out).__name__}; expected a list of floats")
        if len(out) != len(responses):
            raise CustomRewardError(
                f"{name} returned {len(out)} scores; expected {len(responses)}, one per response"
            )
        scores = []
        for i, value in enumerate(out):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise CustomRewardError(
                    f"{name} returned a {type(value).__name__} at index {i} ({value!r}); expected a float"
                )
            if not math.isfinite(value):
                raise CustomRewardError(f"{name} returned a non-finite score at index {i} ({value!r})")
            scores.append(float(value))
        return scores


_MAX_BACKOFF_SECONDS = 30.0
_EXCERPT_CHARS = 200


def _excerpt(body: bytes) -> str:
    """The start of an answer's body, on one line, quoted; or "an empty body"."""
    text = " ".join(body.decode("utf-8", "replace").split())
    if not text:
        return "an empty body"
    return repr(text[:_EXCERPT_CHARS] + ("..." if len(text) > _EXCERPT_CHARS else ""))


def _is_retried(status: int) -> bool:
    """Whether an HTTP status may pass if asked again: too many requests, or the server's own failure."""
    return status == 429 or status >= 500


@dataclass(frozen=True)
class RemoteReward(Reward):
    """Scores from an HTTP endpoint: POST JSON ``{"prompts", "responses", "labels"}`` (equal-length
    lists; a label may be null), answered with HTTP 200 and JSON ``{"scores"}``, one finite number
    per sample, in order.

    The samples go in requests of at most ``batch_size``, ``max_concurrency`` of them in flight at
    once. A request that cannot connect, gets no answer within ``timeout_seconds``, or is answered
    HTTP 429 or 5xx is sent again, up to ``max_retries`` times, after ``backoff_seconds``, then twice
    that, and so on (at most 30 s). Any other answer than the protocol's raises ``RemoteRewardError``
    naming the endpoint and what it answered, as does the last failed try.
    """

    url: str
    """``http://`` or ``https://`` with a host."""
    timeout_seconds: float = 60.0
    """How long a request may wait for the endpoint (connecting, then each read)."""
    max_retries: int = 3
    """Tries after the first one, for the failures that may pass."""
    max_concurrency: int = 4
    """Requests in flight at once."""
    batch_size: int = 64
    """Samples per request."""
    headers_from_env: Mapping[str, str] | None = None
    """Header name -> the environment variable holding its value, read once, here."""
    backoff_seconds: float = 0.5
    """The wait before the first retry; doubled before each next one."""
    _headers: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        try:
            parts.port  # noqa: B018 (reading it checks it)
        except ValueError:
            raise RemoteRewardError(f"reward.remote.url {self.url!r} has a bad port; e.g. http://scorer:8000/score") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteRewardError(
                f"reward.remote.url {self.url!r} is not an http:// or https:// URL with a host; e.g. http://scorer:8000/score"
            )
        headers = {"Content-Type": "application/json"}
        for name, variable in (self.headers_from_env or {}).items():
            value = os.environ.get(variable)
            if value is None:
                raise RemoteRewardError(
                    f"reward.remote.headers: header {name} reads the environment variable {variable}, which is not"
                    f" set: add {variable} to the Secret named in envFromSecret (or export it for a local run)"
                )
            headers[name] = value
        object.__setattr__(self, "_headers", headers)

    def score(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        self._check_lengths(prompts, responses, labels)
        starts = range(0, len(responses), self.batch_size)
        if not starts:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(starts)), thread_name_prefix="reward")
        try:
            parts = pool.map(lambda start: self._score_batch(prompts, responses, labels, start), starts)
            return [score for part in parts for score in part]
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure: the requests not yet sent are not sent

    def _score_batch(self, prompts: list[str], responses: list[str], labels: list[str | None], start: int) -> list[float]:
        end = start + self.batch_size
        body = json.dumps({"prompts": prompts[start:end], "responses": responses[start:end], "labels": labels[start:end]})
        count = len(responses[start:end])
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_seconds * 2 ** (attempt - 1), _MAX_BACKOFF_SECONDS))
            try:
                status, answer = self._post(body.encode())
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, unresolved, timed out
                failure = self._describe_unreachable(exc)
                continue
            if status == 200:
                return self._scores_of(answer, start=start, count=count)
            failure = f"answered HTTP {status}: {_excerpt(answer)}"
            if not _is_retried(status):
                raise RemoteRewardError(f"reward endpoint {self.url} {failure}")
        raise RemoteRewardError(
            f"reward endpoint {self.url} {failure} (the last of {self.max_retries + 1} tries;"
            f" reward.remote.maxRetries {self.max_retries})"
        )

    def _post(self, body: bytes) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as answer:  # a status other than 2xx: still an answer
            with answer:
                return answer.code, answer.read()

    def _describe_unreachable(self, exc: BaseException) -> str:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return f"did not answer within {self.timeout_seconds:g} s (reward.remote.timeoutSeconds)"
        return f"could not be reached ({reason})"

    def _scores_of(self, answer: bytes, *, start: int, count: int) -> list[float]:
        try:
            document = json.loads(answer)  # reads NaN and Infinity too, so that they are named below
        except ValueError:
            document = None
        scores = document.get("scores") if isinstance(document, dict) else None
        if not isinstance(scores, list):
            raise RemoteRewardError(f'reward endpoint {self.url} answered HTTP 200 without JSON {{"scores": [...]}}: {_excerpt(answer)}')
        if len(scores) != count:
            raise RemoteRewardError(
                f"reward endpoint {self.url} answered {len(scores)} scores for {count} samples; expected one per sample, in order"
            )
        for i, value in enumerate(scores, start=start):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RemoteRewardError(f"reward endpoint {self.url}: score {i} is {value!r}, not a number")
            if not math.isfinite(value):
                raise RemoteRewardError(f"reward endpoint {self.url}: score {i} is {value!r}, not a finite number")
        return [float(value) for value in scores]


_REWARD_CLASSES: dict[str, type[Reward]] = {
    "exact_answer": ExactFinalAnswerReward,
    "synthetic": SyntheticReward,
    "remote": RemoteReward,
}
REWARD_KINDS = ("exact_answer", "synthetic", "custom", "remote")


def build_reward(kind: str, *, custom_function: str | None = None, **options: Any) -> Reward:
    """Build the reward ``kind`` (``exact_answer``, ``synthetic``, ``custom`` or ``remote``) from its options.

    ``custom`` needs ``custom_function`` (a function reference) and takes no options; the other
    kinds take their dataclass fields as options. Unknown kinds and options raise ValueError
    listing the valid ones.
    """
    if kind not in REWARD_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; valid kinds: {', '.join(REWARD_KINDS)}")
    if kind == "custom":
        if not custom_function:
            raise ValueError("reward kind 'custom' needs custom_function, e.g. 'my_package.rewards:score'")
        if options:
            raise ValueError(f"reward kind 'custom' takes no options; got {', '.join(sorted(options))}")
        return CustomReward.load(custom_function)
    if custom_function is not None:
        raise ValueError(f"custom_function is only used with reward kind 'custom', not {kind!r}")
    cls = _REWARD_CLASSES[kind]
    valid = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for reward kind {kind!r}; valid options: "
            f"{', '.join(valid) or '(none)'}"
        )
    return cls(**options)
