"""The offload state machine: each role is awake or asleep and moves only through explicit transitions.

A `Residency` wraps one role's two states (an actor's OnDevice/Offloaded, a rollout engine's
Awake/Asleep, the actor's weight-sync link Connected/Disconnected). `sleep(release)` and
`wake(restore)` run the given action only when the state actually changes, so asleep -> asleep
is a no-op, not a crash (the seed framework's double `sleep()` crashed). Every change is
reported to a listener as a `Transition` with its duration; `require_awake` turns an illegal use
(training while offloaded) into a clear error. Depends on the standard library and the API
vocabulary only; it knows nothing of torch or Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ppojob_api.vocabulary import RolloutResidency, TrainResidency

CONNECTED = "Connected"
DISCONNECTED = "Disconnected"


class OffloadError(RuntimeError):
    """A role was used in a state that does not allow it (e.g. trained while offloaded)."""


@dataclass(frozen=True)
class Transition:
    """One change of state of one role's rank, as reported to listeners."""

    role: str
    rank: int
    from_state: str
    to_state: str
    seconds: float
    time: float
    """Wall-clock time (time.time()) when the transition finished."""

    def __str__(self) -> str:
        return f"{self.role}[{self.rank}] {self.from_state} -> {self.to_state} ({self.seconds:.3f}s)"


Listener = Callable[[Transition], None]


class Residency:
    """Two states, awake and asleep, and the only two ways between them."""

    def __init__(
        self,
        role: str,
        *,
        awake_state: str,
        asleep_state: str,
        rank: int = 0,
        awake: bool = True,
        listener: Listener | None = None,
    ) -> None:
        self.role = role
        self.rank = rank
        self.awake_state = awake_state
        self.asleep_state = asleep_state
        self._awake = awake
        self._listeners: list[Listener] = [listener] if listener else []

    @classmethod
    def for_train_role(cls, role: str, *, rank: int = 0, listener: Listener | None = None) -> Residency:
        """An actor, critic or reference model: OnDevice (awake) or Offloaded. Starts on device."""
        on, off = TrainResidency.ON_DEVICE.value, TrainResidency.OFFLOADED.value
        return cls(role, awake_state=on, asleep_state=off, rank=rank, listener=listener)

    @classmethod
    def for_rollout(cls, role: str = "rollout", *, rank: int = 0, listener: Listener | None = None) -> Residency:
        """A rollout engine: Awake or Asleep (memory released). Starts awake."""
        awake, asleep = RolloutResidency.AWAKE.value, RolloutResidency.ASLEEP.value
        return cls(role, awake_state=awake, asleep_state=asleep, rank=rank, listener=listener)

    @classmethod
    def for_link(cls, role: str, *, rank: int = 0, listener: Listener | None = None) -> Residency:
        """A connection (the actor's weight-sync group): awake means connected. Starts disconnected."""
        return cls(role, awake_state=CONNECTED, asleep_state=DISCONNECTED, rank=rank, awake=False, listener=listener)

    @property
    def awake(self) -> bool:
        return self._awake

    @property
    def state(self) -> str:
        return self.awake_state if self._awake else self.asleep_state

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def sleep(self, release: Callable[[], None]) -> bool:
        """Run `release` and become asleep; a no-op when already asleep. Returns whether it changed."""
        return self._move(to_awake=False, action=release)

    def wake(self, restore: Callable[[], None]) -> bool:
        """Run `restore` and become awake; a no-op when already awake. Returns whether it changed."""
        return self._move(to_awake=True, action=restore)

    def require_awake(self, action: str) -> None:
        if not self._awake:
            raise OffloadError(
                f"{self.role}[{self.rank}] cannot {action} while {self.asleep_state}: wake it first "
                f"(the role's wake() brings it back to {self.awake_state})"
            )

    def _move(self, *, to_awake: bool, action: Callable[[], None]) -> bool:
        if self._awake == to_awake:
            return False
        before = self.state
        started = time.perf_counter()
        action()
        self._awake = to_awake
        transition = Transition(
            role=self.role,
            rank=self.rank,
            from_state=before,
            to_state=self.state,
            seconds=time.perf_counter() - started,
            time=time.time(),
        )
        for listener in self._listeners:
            listener(transition)
        return True
