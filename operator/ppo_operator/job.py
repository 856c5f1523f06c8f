"""A PPOJob as the operator reads it: an immutable view of one observed version of the object.

`Job.from_body` copies what the reconcile needs out of a kopf body (or any dict of the object),
so pure functions (builders, compute_status) take a `Job` and never a live, changing mapping.
Depends on the API package and the standard library only.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ppojob_api.spec import PPOJobSpec, SpecError, parse_spec
from ppojob_api.vocabulary import API_VERSION, KIND


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    uid: str
    generation: int
    resource_version: str
    raw_spec: Mapping[str, Any]
    status: Mapping[str, Any]
    deleting: bool = False
    report: Mapping[str, Any] | None = None
    """The trainer's latest report (its progress ConfigMap), newer than `status.progress` or equal to it."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Job:
        meta = body.get("metadata", {})
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace", "default"),
            uid=meta["uid"],
            generation=int(meta.get("generation", 1)),
            resource_version=str(meta.get("resourceVersion", "")),
            raw_spec=copy.deepcopy(dict(body.get("spec") or {})),
            status=copy.deepcopy(dict(body.get("status") or {})),
            deleting=bool(meta.get("deletionTimestamp")),
        )

    @property
    def attempt(self) -> int:
        return int(self.status.get("attempt") or 0)

    @property
    def progress(self) -> Mapping[str, Any]:
        """What the trainer reported last: its report, or (before its first) the status as stored."""
        if self.report is not None:
            return self.report
        return self.status.get("progress") or {}

    def with_report(self, report: Mapping[str, Any] | None) -> Job:
        return self if report is None else dataclasses.replace(self, report=copy.deepcopy(dict(report)))

    def parse(self) -> tuple[PPOJobSpec | None, str | None]:
        """The typed spec, or None and every problem in one message (never raises)."""
        return _parse(json.dumps(self.raw_spec, sort_keys=True))

    def owner_reference(self) -> dict[str, Any]:
        """Makes the job the controller of a child, so that deleting the job deletes the child."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@functools.lru_cache(maxsize=1024)
def _parse(spec_json: str) -> tuple[PPOJobSpec | None, str | None]:
    """Parsed by content, once: a reconcile reads the spec several times, and the operator reconciles
    on every report and child event (the typed spec is frozen, so it is safe to share)."""
    try:
        return parse_spec(json.loads(spec_json)), None
    except SpecError as exc:
        return None, "; ".join(exc.problems)


def parse_time(value: str | None) -> datetime | None:
    """RFC 3339 (as the API server writes it) -> aware datetime, or None."""
    if not value:
        return None
    return datetime.fromisoformat(value)


def format_time(value: datetime) -> str:
    """Aware datetime -> RFC 3339 in UTC, to the second (as Kubernetes' own timestamps)."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
