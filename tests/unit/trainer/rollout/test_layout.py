"""aligned_rows: the training passes' layout (each row's real tokens from column 0)."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.batch import RolloutBatch
from ppo_trainer.rollout.layout import aligned_rows


def batch() -> RolloutBatch:
    # P = 3, T = 3. Row 0: prompt [5, 6, 7], response [8, 9] (then pad 0). Row 1: prompt [4] (left-padded),
    # response [1, 2, 3].
    tokens = torch.tensor([[5, 6, 7, 8, 9, 0], [0, 0, 4, 1, 2, 3]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=attention[:, 3:].float(),
                        prompt_length=3, rollout_log_probs=torch.zeros(2, 3), scores=torch.zeros(2))


def test_real_tokens_start_at_column_zero_and_each_prediction_column_precedes_its_target():
    aligned = aligned_rows(batch(), torch.arange(2))
    # Width: longest prompt (3) + kept (3) - 1: the last response token is never an input.
    assert aligned.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 1, 2, 3, 0]]
    assert aligned.predict_at.tolist() == [[2, 3, 4], [0, 1, 2]]
    assert aligned.targets.tolist() == [[8, 9, 0], [1, 2, 3]]
    assert aligned.real.tolist() == [[True, True, False], [True, True, True]]
    # Where a next input token exists, it is the target the column predicts.
    for row in range(2):
        for t in range(aligned.kept):
            column = int(aligned.predict_at[row, t])
            if aligned.real[row, t] and column + 1 < aligned.input_ids.shape[1]:
                assert aligned.input_ids[row, column + 1] == aligned.targets[row, t]


def test_responses_are_cut_to_the_longest_among_the_rows_and_widths_round_up():
    only_first = aligned_rows(batch(), torch.tensor([0]), width_multiple=8)
    assert only_first.kept == 2 and only_first.input_ids.shape == (1, 8)
    assert only_first.input_ids[0, :5].tolist() == [5, 6, 7, 8, 9] and only_first.input_ids[0, 5:].eq(0).all()


def test_width_multiple_must_be_positive():
    with pytest.raises(ValueError, match="width_multiple must be >= 1"):
        aligned_rows(batch(), torch.arange(2), width_multiple=0)


def test_real_outputs_pick_what_gathering_at_predict_at_and_masking_picks():
    aligned = aligned_rows(batch(), torch.arange(2), width_multiple=8)
    outputs = torch.randn(*aligned.input_ids.shape, 3)  # [b, W, H], a model's per-column outputs
    gathered = outputs.gather(1, aligned.predict_at[:, :, None].expand(-1, -1, 3))[aligned.real]
    picked = outputs.reshape(-1, 3).index_select(0, aligned.real_outputs())
    assert len(picked) == int(aligned.real.sum()) > 0
    assert torch.equal(picked, gathered)
