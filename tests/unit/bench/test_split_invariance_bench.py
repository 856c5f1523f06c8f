"""bench/split_invariance: one step's gradients through the product's roles, under two splits of the batch."""

import split_invariance


def test_micro_batches_leave_one_rank_s_gradients_at_round_off():
    whole = split_invariance.gradients(1, 32, None)
    split = split_invariance.gradients(1, 4, None)
    for role in ("actor", "critic"):
        assert whole[role].norm() > 0
        assert float((split[role] - whole[role]).norm() / whole[role].norm()) < 1e-5, role
