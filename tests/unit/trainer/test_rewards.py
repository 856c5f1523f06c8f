"""Reward functions: final-answer extraction, the synthetic task, the custom hook, the builder."""

from __future__ import annotations

import random
import textwrap

import pytest

from ppo_trainer.rewards import (
    REWARD_KINDS,
    CustomReward,
    CustomRewardError,
    ExactFinalAnswerReward,
    Reward,
    SyntheticReward,
    build_reward,
    extract_final_answer,
)


def score_one(reward: Reward, response: str, label: str | None = None) -> float:
    return reward.score(["p"], [response], [label])[0]


# --- exact final answer ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,answer",
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234\nthanks", "1,234"),
        ("The answer is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("I think 3 apples and then 12 pears", "12"),
        ("costs $5.50.", "5.50"),
        ("x = -3", "-3"),
        ("Paris", "Paris"),
        ("unbalanced \\boxed{3", "3"),
    ],
)
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("Let me think. 2 + 2 = 4. #### 4", "4", 1.0),
        ("\\boxed{72}", "Natalia sold 48/2 = 24 clips... 48 + 24 = 72\n#### 72", 1.0),  # GSM8K-style label
        ("so the total is 1,000", "1000", 1.0),
        ("it is 3.0", "3", 1.0),
        ("3 then 5", "3", 0.0),  # the LAST number counts
        ("#### 5", "4", 0.0),
        ("no numbers here", "4", 0.0),
        ("paris", "Paris", 1.0),
        ("", "4", 0.0),
    ],
)
def test_exact_final_answer_reward(response, label, expected):
    assert score_one(ExactFinalAnswerReward(), response, label) == expected


def test_exact_final_answer_reward_needs_labels():
    with pytest.raises(ValueError, match=r"labels\[1\] is None"):
        ExactFinalAnswerReward().score(["a", "b"], ["1", "2"], ["1", None])


def test_reward_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match=r"same length; got 2, 1 and 2"):
        SyntheticReward().score(["a", "b"], ["x"], [None, None])


# --- synthetic task ----------------------------------------------------------------------------


def test_synthetic_reward_is_fraction_of_target_characters():
    reward = SyntheticReward(target="a")
    assert reward.score(["p"] * 4, ["aaaa", "abab", "xyz", ""], [None] * 4) == [1.0, 0.5, 0.0, 0.0]


def test_synthetic_reward_with_several_target_characters():
    assert score_one(SyntheticReward(target="ae"), "aebx") == 0.5


def test_synthetic_reward_is_dense_and_near_zero_for_random_bytes():
    # A random byte-level model hits 'a' about 1/256 of the time: a small but nonzero start,
    # and every extra 'a' raises the score, so PPO has a gradient to follow.
    rng = random.Random(0)
    responses = [
        bytes(rng.randrange(256) for _ in range(32)).decode("utf-8", errors="replace") for _ in range(64)
    ]
    scores = SyntheticReward().score(["p"] * 64, responses, [None] * 64)
    assert 0.0 < sum(scores) / len(scores) < 0.02
    assert score_one(SyntheticReward(), "a" + "x" * 31) < score_one(SyntheticReward(), "aa" + "x" * 30)


def test_synthetic_reward_rejects_empty_target():
    with pytest.raises(ValueError, match="target must be a non-empty string"):
        SyntheticReward(target="")


# --- custom hook -------------------------------------------------------------------------------

CUSTOM_SOURCE = textwrap.dedent(
    """
    import math

    def length(prompts, responses, labels):
        return [float(len(r)) for r in responses]

    def too_few(prompts, responses, labels):
        return [0.0]

    def with_nan(prompts, responses, labels):
        return [math.nan for _ in responses]

    def with_string(prompts, responses, labels):
        return ["1.0" for _ in responses]

    def as_dict(prompts, responses, labels):
        return {"scores": [0.0]}

    def crashes(prompts, responses, labels):
        return 1 / 0

    def two_parameters(prompts, responses):
        return [0.0 for _ in responses]

    def any_arguments(*args, **kwargs):
        return [0.0 for _ in args[1]]
    """
)


@pytest.fixture()
def custom_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(CUSTOM_SOURCE)
    return path


def test_custom_reward_from_file(custom_file):
    reward = build_reward("custom", custom_function=f"{custom_file}:length")
    assert isinstance(reward, CustomReward)
    assert reward.score(["p", "q"], ["ab", "abcd"], [None, None]) == [2.0, 4.0]


def test_custom_reward_accepts_a_plain_callable():
    reward = CustomReward(fn=lambda prompts, responses, labels: [1] * len(responses))
    assert reward.score(["p"], ["r"], [None]) == [1.0]


@pytest.mark.parametrize(
    "name,message",
    [
        ("too_few", r"too_few returned 1 scores; expected 2, one per response"),
        ("with_nan", r"with_nan returned a non-finite score at index 0 \(nan\)"),
        ("with_string", r"with_string returned a str at index 0 \('1\.0'\); expected a float"),
        ("as_dict", r"as_dict returned dict; expected a list of floats"),
        ("crashes", r"crashes raised ZeroDivisionError"),
    ],
)
def test_custom_reward_bad_output_names_the_function(custom_file, name, message):
    reward = build_reward("custom", custom_function=f"{custom_file}:{name}")
    with pytest.raises(CustomRewardError, match=rf"my_rewards\.py:{message}"):
        reward.score(["p", "q"], ["a", "b"], [None, None])


def test_custom_reward_load_errors(custom_file):
    with pytest.raises(CustomRewardError, match=r"custom reward function 'nocolon' has the wrong form"):
        build_reward("custom", custom_function="nocolon")
    with pytest.raises(CustomRewardError, match=r"has no attribute 'missing'"):
        build_reward("custom", custom_function=f"{custom_file}:missing")
    with pytest.raises(CustomRewardError, match=r"two_parameters' cannot be called as fn\(prompts, responses, labels\)"):
        build_reward("custom", custom_function=f"{custom_file}:two_parameters")
    assert build_reward("custom", custom_function=f"{custom_file}:any_arguments").score(["p"], ["r"], [None]) == [0.0]


# --- builder -----------------------------------------------------------------------------------


def test_build_reward_kinds():
    assert REWARD_KINDS == ("exact_answer", "synthetic", "custom", "remote")
    assert build_reward("exact_answer") == ExactFinalAnswerReward()
    assert build_reward("synthetic", target="b") == SyntheticReward(target="b")


def test_build_reward_unknown_kind_lists_valid_kinds():
    with pytest.raises(
        ValueError, match=r"unknown reward kind 'gsm8k'; valid kinds: exact_answer, synthetic, custom, remote"
    ):
        build_reward("gsm8k")


def test_build_reward_unknown_option_lists_valid_options():
    with pytest.raises(
        ValueError, match=r"unknown option\(s\) letter for reward kind 'synthetic'; valid options: target"
    ):
        build_reward("synthetic", letter="a")


def test_build_reward_custom_needs_function_and_takes_no_options(custom_file):
    with pytest.raises(ValueError, match="needs custom_function"):
        build_reward("custom")
    with pytest.raises(ValueError, match="takes no options"):
        build_reward("custom", custom_function=f"{custom_file}:length", target="a")
    with pytest.raises(ValueError, match="only used with reward kind 'custom'"):
        build_reward("synthetic", custom_function=f"{custom_file}:length")
