"""Loading a user's function by reference, and checking a custom advantage function's output.

A reference is ``"package.module:function"`` (imported) or ``"/path/to/file.py:function"``
(executed from that file). ``load_function`` is shared with the custom reward hook.

The contract of a custom advantage function (it replaces GAE)::

    def my_advantages(batch: AdvantageInputs) -> AdvantageOutputs | dict:
        ...

``batch`` holds, for one batch of ``B`` responses right-padded to length ``T``:

* ``rewards`` ``[B, T]``: the KL-shaped per-token rewards (``kl_shaped_rewards``: ``-kl_coef * KL``
  at every response token plus the sequence score at the last one); the same rewards GAE would use.
* ``values`` ``[B, T]``: the critic's values (before its update this step).
* ``mask`` ``[B, T]``: 1 on real response tokens, 0 on padding.
* ``scores`` ``[B]``: the sequence rewards, before KL shaping.
* ``gamma``, ``lam``: the configured discount and GAE lambda (use them or not).

The tensors are copies: changing them in place changes nothing in the trainer. The function must
return ``advantages`` and ``returns`` (the critic's targets), either as an ``AdvantageOutputs`` (or
any object with those attributes) or as a dict with those keys; each a floating-point tensor of the
mask's shape ``[B, T]``, finite wherever the mask is 1. Entries where the mask is 0 are ignored
(set to 0). Any violation raises ``CustomAdvantageError`` naming the function and the problem.

Load the function in the process that calls it; a loaded function pickles as its reference and
is loaded again on the other side (a file path must exist there too). Nothing here may depend on
Ray or on configuration objects.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AdvantageInputs",
    "AdvantageOutputs",
    "CustomAdvantageError",
    "FunctionReferenceError",
    "LoadedFunction",
    "compute_custom_advantages",
    "describe_function",
    "load_advantage_function",
    "load_function",
]


class FunctionReferenceError(ValueError):
    """A ``"module:function"`` or ``"file.py:function"`` reference could not be loaded."""


class CustomAdvantageError(ValueError):
    """A custom advantage function could not be loaded, failed, or returned a bad output."""


@dataclass(frozen=True)
class AdvantageInputs:
    """What a custom advantage function receives (see the module docstring)."""

    rewards: Tensor
    """[B, T] KL-shaped per-token rewards, zero on padding."""
    values: Tensor
    """[B, T] critic values."""
    mask: Tensor
    """[B, T] 1 on real response tokens."""
    scores: Tensor
    """[B] sequence rewards before KL shaping."""
    gamma: float
    """Discount factor."""
    lam: float
    """GAE lambda."""

    def __post_init__(self) -> None:
        for name in ("rewards", "values", "mask", "scores"):
            if not isinstance(getattr(self, name), Tensor):
                raise TypeError(
                    f"AdvantageInputs.{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}"
                )
        if self.mask.dim() != 2:
            raise ValueError(f"AdvantageInputs.mask must be [B, T], got shape {tuple(self.mask.shape)}")
        for name in ("rewards", "values"):
            shape = tuple(getattr(self, name).shape)
            if shape != tuple(self.mask.shape):
                raise ValueError(
                    f"AdvantageInputs.{name} has shape {shape}; expected {tuple(self.mask.shape)}, the mask's shape"
                )
        if tuple(self.scores.shape) != (self.mask.shape[0],):
            raise ValueError(
                f"AdvantageInputs.scores has shape {tuple(self.scores.shape)}; expected ({self.mask.shape[0]},)"
            )


@dataclass(frozen=True)
class AdvantageOutputs:
    """What a custom advantage function returns: both ``[B, T]``."""

    advantages: Tensor
    """[B, T] advantages for the policy loss."""
    returns: Tensor
    """[B, T] targets for the value loss."""


@dataclass(frozen=True)
class LoadedFunction:
    """A user's function together with the reference it was loaded from; calls go to ``fn``."""

    ref: str
    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __str__(self) -> str:
        return self.ref

    def __reduce__(self) -> tuple[Any, ...]:
        return (load_function, (self.ref,))


def describe_function(fn: Callable[..., Any]) -> str:
    """The name to show in errors: the reference it was loaded from, else ``module:qualname``."""
    if isinstance(fn, LoadedFunction):
        return fn.ref
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}" if module else qualname


def _import_file(path: Path, ref: str) -> Any:
    if path.suffix != ".py":
        raise FunctionReferenceError(
            f"{ref!r}: {str(path)!r} is not a Python file; expected a path ending in .py"
        )
    if not path.is_file():
        raise FunctionReferenceError(f"{ref!r}: file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    module_name = f"_ppo_user_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FunctionReferenceError(f"{ref!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise FunctionReferenceError(
            f"{ref!r}: executing {str(path)!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def load_function(ref: str) -> LoadedFunction:
    """Load ``"package.module:function"`` or ``"/path/to/file.py:function"``.

    Raises ``FunctionReferenceError`` (a ValueError) naming the reference when the form is wrong,
    the module or file is missing or fails to import, the attribute is missing, or it is not
    callable. ``function`` may be dotted (``module:Class.method``).
    """
    if not isinstance(ref, str) or ref.count(":") < 1:
        raise FunctionReferenceError(
            f"{ref!r} has the wrong form; expected 'package.module:function' or '/path/to/file.py:function'"
        )
    target, _, attr_path = ref.rpartition(":")
    if not target or not attr_path or not all(part.isidentifier() for part in attr_path.split(".")):
        raise FunctionReferenceError(
            f"{ref!r} has the wrong form; expected 'package.module:function' or '/path/to/file.py:function'"
        )

    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(Path(target).expanduser(), ref)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise FunctionReferenceError(
                f"{ref!r}: module {target!r} not found ({exc}); install it or put it on PYTHONPATH, "
                f"or give a file path like '/path/to/file.py:function'"
            ) from exc
        except Exception as exc:
            raise FunctionReferenceError(
                f"{ref!r}: importing {target!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise FunctionReferenceError(f"{ref!r}: {target!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FunctionReferenceError(
            f"{ref!r}: {attr_path!r} is not callable (it is of type {type(obj).__name__})"
        )
    return LoadedFunction(ref=ref, fn=obj)


def load_advantage_function(ref: str) -> LoadedFunction:
    """Load a custom advantage function from its reference (see ``load_function``).

    Raises ``CustomAdvantageError`` with ``load_function``'s message when it cannot be loaded.
    """
    try:
        return load_function(ref)
    except FunctionReferenceError as exc:
        raise CustomAdvantageError(f"custom advantage function {exc}") from exc


def _get_output(out: Any, key: str, name: str) -> Any:
    if isinstance(out, Mapping):
        if key not in out:
            raise CustomAdvantageError(
                f"{name} returned a dict without {key!r} (keys: {sorted(map(str, out))}); "
                f"it must return 'advantages' and 'returns'"
            )
        return out[key]
    if not hasattr(out, key):
        raise CustomAdvantageError(
            f"{name} returned {type(out).__name__} without {key!r}; it must return an AdvantageOutputs "
            f"or a dict with keys 'advantages' and 'returns'"
        )
    return getattr(out, key)


def _check_output(value: Any, key: str, name: str, mask: Tensor) -> Tensor:
    if not isinstance(value, Tensor):
        raise CustomAdvantageError(
            f"{name} returned {key} of type {type(value).__name__}; expected a torch.Tensor"
        )
    if tuple(value.shape) != tuple(mask.shape):
        raise CustomAdvantageError(
            f"{name} returned {key} of shape {tuple(value.shape)}; expected {tuple(mask.shape)}, "
            f"the response mask's shape"
        )
    if not value.is_floating_point():
        raise CustomAdvantageError(
            f"{name} returned {key} of dtype {value.dtype}; expected a floating-point tensor"
        )
    valid = mask.to(value.device).bool()
    bad = valid & ~torch.isfinite(value)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise CustomAdvantageError(
            f"{name} returned {key} with {int(bad.sum())} non-finite value(s) (nan or inf) at valid "
            f"(mask=1) positions, the first at {first}"
        )
    return torch.where(valid, value, torch.zeros_like(value))


def compute_custom_advantages(fn: Callable[..., Any], inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Call ``fn`` on copies of ``inputs`` and return its validated ``(advantages, returns)``.

    Both are ``[B, T]``, zero where the mask is 0. Raises ``CustomAdvantageError`` naming the
    function when it raises, returns nothing, or returns a missing, non-tensor, wrongly shaped,
    non-floating or non-finite (on valid tokens) ``advantages`` or ``returns``.
    """
    name = describe_function(fn)
    batch = AdvantageInputs(
        rewards=inputs.rewards.clone(),
        values=inputs.values.clone(),
        mask=inputs.mask.clone(),
        scores=inputs.scores.clone(),
        gamma=inputs.gamma,
        lam=inputs.lam,
    )
    try:
        out = fn(batch)
    except CustomAdvantageError:
        raise
    except Exception as exc:
        raise CustomAdvantageError(f"{name} raised {type(exc).__name__}: {exc}") from exc
    if out is None:
        raise CustomAdvantageError(
            f"{name} returned None; it must return an AdvantageOutputs or a dict with keys 'advantages' and 'returns'"
        )
    advantages = _check_output(_get_output(out, "advantages", name), "advantages", name, inputs.mask)
    returns = _check_output(_get_output(out, "returns", name), "returns", name, inputs.mask)
    return advantages, returns
