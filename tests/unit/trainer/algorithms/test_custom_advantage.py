"""Loading a custom advantage function by reference, and the checks on what it returns."""

from __future__ import annotations

import pickle
import sys
import textwrap

import pytest
import torch

from ppo_trainer.algorithms import gae
from ppo_trainer.algorithms.custom_advantage import (
    AdvantageInputs,
    AdvantageOutputs,
    CustomAdvantageError,
    FunctionReferenceError,
    LoadedFunction,
    compute_custom_advantages,
    load_advantage_function,
    load_function,
)

MODULE_SOURCE = textwrap.dedent(
    """
    import torch
    from ppo_trainer.algorithms import gae
    from ppo_trainer.algorithms.custom_advantage import AdvantageOutputs

    NOT_CALLABLE = 3

    def gae_as_dict(batch):
        advantages, returns = gae(batch.rewards, batch.values, batch.mask, gamma=batch.gamma, lam=batch.lam)
        return {"advantages": advantages, "returns": returns}

    def reward_to_go(batch):
        returns = batch.rewards.flip(1).cumsum(1).flip(1)
        return AdvantageOutputs(advantages=returns - batch.values, returns=returns)

    def wrong_shape(batch):
        return {"advantages": batch.rewards[:, :-1], "returns": batch.rewards}

    def forgets_returns(batch):
        return {"advantages": batch.rewards}

    def returns_nothing(batch):
        batch.rewards.mul_(0)  # in place: must not reach the trainer's tensors

    def nan_on_valid(batch):
        adv = batch.rewards.clone()
        adv[1, 0] = float("nan")
        return {"advantages": adv, "returns": batch.rewards}

    def nan_on_padding(batch):
        adv = torch.where(batch.mask.bool(), batch.rewards, torch.full_like(batch.rewards, float("nan")))
        return {"advantages": adv, "returns": batch.rewards}

    def list_output(batch):
        return {"advantages": batch.rewards.tolist(), "returns": batch.rewards}

    def integer_output(batch):
        return {"advantages": batch.mask.long(), "returns": batch.rewards}

    def raises(batch):
        raise KeyError("advantages")

    class Holder:
        @staticmethod
        def method(batch):
            return gae_as_dict(batch)
    """
)


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_adv.py"
    path.write_text(MODULE_SOURCE)
    return path


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    package = tmp_path / "pkg_adv_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "funcs.py").write_text(MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pkg_adv_test.funcs"
    for name in [n for n in sys.modules if n.startswith("pkg_adv_test")]:
        del sys.modules[name]


def make_inputs() -> AdvantageInputs:
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float32)
    return AdvantageInputs(
        rewards=torch.randn(3, 4, generator=gen) * mask,
        values=torch.randn(3, 4, generator=gen),
        mask=mask,
        scores=torch.randn(3, generator=gen),
        gamma=0.99,
        lam=0.95,
    )


# --- loading -----------------------------------------------------------------------------------


def test_load_from_module_reference(user_module):
    fn = load_advantage_function(f"{user_module}:gae_as_dict")
    assert isinstance(fn, LoadedFunction)
    assert fn.ref == f"{user_module}:gae_as_dict" and str(fn) == fn.ref
    assert fn.fn is sys.modules[user_module].gae_as_dict


def test_load_from_file_path(user_file):
    fn = load_advantage_function(f"{user_file}:reward_to_go")
    adv, ret = compute_custom_advantages(fn, make_inputs())
    assert adv.shape == ret.shape == (3, 4)


def test_load_dotted_attribute(user_module):
    assert callable(load_advantage_function(f"{user_module}:Holder.method"))


@pytest.mark.parametrize("ref", ["pkg.module.function", "module:", ":function", "mod:not-an-identifier", ""])
def test_load_bad_format_names_the_expected_form(ref):
    with pytest.raises(CustomAdvantageError, match=r"wrong form; expected 'package\.module:function'"):
        load_advantage_function(ref)


def test_load_missing_module():
    with pytest.raises(CustomAdvantageError, match=r"module 'no_such_module_xyz' not found"):
        load_advantage_function("no_such_module_xyz:fn")


def test_load_missing_file(tmp_path):
    with pytest.raises(CustomAdvantageError, match=r"does not exist"):
        load_advantage_function(f"{tmp_path}/absent.py:fn")


def test_load_file_that_fails_to_execute(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(CustomAdvantageError, match=r"executing .*broken\.py.* failed: RuntimeError: boom"):
        load_advantage_function(f"{path}:fn")


def test_load_missing_attribute(user_file):
    with pytest.raises(CustomAdvantageError, match=r"has no attribute 'nope'"):
        load_advantage_function(f"{user_file}:nope")


def test_load_not_callable(user_file):
    with pytest.raises(CustomAdvantageError, match=r"'NOT_CALLABLE' is not callable \(it is of type int\)"):
        load_advantage_function(f"{user_file}:NOT_CALLABLE")


def test_load_errors_are_value_errors_and_the_generic_loader_has_its_own_type():
    assert issubclass(CustomAdvantageError, ValueError) and issubclass(FunctionReferenceError, ValueError)
    with pytest.raises(FunctionReferenceError):
        load_function("nope")


def test_loaded_function_pickles_as_its_reference(user_module):
    fn = load_advantage_function(f"{user_module}:gae_as_dict")
    clone = pickle.loads(pickle.dumps(fn))
    assert clone.ref == fn.ref and clone.fn is fn.fn


# --- computing and validating ------------------------------------------------------------------


def test_gae_as_a_custom_function_equals_builtin_gae(user_module):
    inputs = make_inputs()
    adv, ret = compute_custom_advantages(load_advantage_function(f"{user_module}:gae_as_dict"), inputs)
    ref_adv, ref_ret = gae(inputs.rewards, inputs.values, inputs.mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=0)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=0)


def test_plain_callable_returning_dataclass():
    def fn(batch):
        return AdvantageOutputs(advantages=batch.rewards * 2, returns=batch.rewards)

    adv, _ = compute_custom_advantages(fn, make_inputs())
    assert adv.shape == (3, 4)


def test_error_names_function_and_wrong_shape(user_module):
    fn = load_advantage_function(f"{user_module}:wrong_shape")
    expected = rf"{user_module}:wrong_shape returned advantages of shape \(3, 3\); expected \(3, 4\), the response mask's shape"
    with pytest.raises(CustomAdvantageError, match=expected):
        compute_custom_advantages(fn, make_inputs())


def test_error_for_missing_returns(user_module):
    with pytest.raises(CustomAdvantageError, match=r"forgets_returns returned a dict without 'returns'"):
        compute_custom_advantages(load_advantage_function(f"{user_module}:forgets_returns"), make_inputs())


def test_error_for_none_and_inputs_are_copies(user_module):
    inputs = make_inputs()
    before = inputs.rewards.clone()
    with pytest.raises(
        CustomAdvantageError, match=r"returns_nothing returned None; it must return an AdvantageOutputs"
    ):
        compute_custom_advantages(load_advantage_function(f"{user_module}:returns_nothing"), inputs)
    assert torch.equal(inputs.rewards, before)


def test_error_for_non_finite_on_valid_tokens(user_module):
    with pytest.raises(
        CustomAdvantageError, match=r"nan_on_valid returned advantages with 1 non-finite .* first at \[1, 0\]"
    ):
        compute_custom_advantages(load_advantage_function(f"{user_module}:nan_on_valid"), make_inputs())


def test_non_finite_on_padding_is_ignored_and_zeroed(user_module):
    inputs = make_inputs()
    adv, _ = compute_custom_advantages(load_advantage_function(f"{user_module}:nan_on_padding"), inputs)
    assert torch.isfinite(adv).all()
    assert (adv[inputs.mask == 0] == 0).all()


def test_error_for_non_tensor(user_module):
    with pytest.raises(
        CustomAdvantageError, match=r"list_output returned advantages of type list; expected a torch\.Tensor"
    ):
        compute_custom_advantages(load_advantage_function(f"{user_module}:list_output"), make_inputs())


def test_error_for_integer_tensor(user_module):
    with pytest.raises(
        CustomAdvantageError, match=r"integer_output returned advantages of dtype torch\.int64"
    ):
        compute_custom_advantages(load_advantage_function(f"{user_module}:integer_output"), make_inputs())


def test_error_wraps_exceptions_raised_by_the_function(user_module):
    with pytest.raises(CustomAdvantageError, match=rf"{user_module}:raises raised KeyError"):
        compute_custom_advantages(load_advantage_function(f"{user_module}:raises"), make_inputs())


def test_error_names_a_plain_callable_by_qualified_name():
    def bad(batch):
        return object()

    with pytest.raises(
        CustomAdvantageError, match=r"test_custom_advantage:.*bad returned object without 'advantages'"
    ):
        compute_custom_advantages(bad, make_inputs())


def test_inputs_are_frozen_and_checked():
    inputs = make_inputs()
    with pytest.raises(AttributeError):
        inputs.gamma = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"AdvantageInputs\.values has shape \(3, 5\); expected \(3, 4\)"):
        AdvantageInputs(inputs.rewards, torch.zeros(3, 5), inputs.mask, inputs.scores, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"AdvantageInputs\.scores has shape \(4,\); expected \(3,\)"):
        AdvantageInputs(inputs.rewards, inputs.values, inputs.mask, torch.zeros(4), 1.0, 1.0)
    with pytest.raises(TypeError, match=r"AdvantageInputs\.rewards must be a torch\.Tensor"):
        AdvantageInputs([[0.0]], inputs.values, inputs.mask, inputs.scores, 1.0, 1.0)  # type: ignore[arg-type]
