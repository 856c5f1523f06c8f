"""The output layer's log-probs and entropies on a real GPU, compiled in bfloat16: the logits kept
for the backward give the gradients that recomputing them gives. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.algorithms.ppo import chunked_log_probs_and_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_kept_logits_train_as_recomputed_ones_compiled_in_bfloat16():
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(5000, 512, generator=generator, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8192, 512, generator=generator, device="cuda", dtype=torch.bfloat16) / 16
    tokens = torch.randint(0, 8192, (5000,), generator=generator, device="cuda")
    a, b = torch.randn(2, 5000, generator=generator, device="cuda")
    results = []
    for kept in (0, 2048 * 8192 * 2, 2**40):  # none, the first chunk, every chunk
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = chunked_log_probs_and_entropy(h, w, tokens, compiled=True, kept_logits_bytes=kept)
        ((lp * a).sum() + (ent * b).sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_the_fused_kernels_match_the_compiled_float32_arithmetic_on_a_full_vocabulary(with_entropy):
    """bf16 logits over Qwen2.5's 151,936 tokens: the kernels against `torch.compile` of the same
    arithmetic in float32, values and the logits' gradient."""
    from ppo_trainer.algorithms.log_softmax_kernel import fused_log_softmax
    from ppo_trainer.algorithms.ppo import _log_softmax_chunk

    generator = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(3000, 151936, generator=generator, device="cuda") * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 151936, (3000,), generator=generator, device="cuda")
    a, b = torch.randn(2, 3000, generator=generator, device="cuda")
    results = []
    for fn in (fused_log_softmax, torch.compile(_log_softmax_chunk, dynamic=True)):
        x = logits.clone().requires_grad_()
        picked, entropy = fn(x, tokens, 0.9, with_entropy)
        objective = (picked * a).sum() + ((entropy * b).sum() if with_entropy else 0)
        objective.backward()
        results.append((picked.detach(), entropy.detach(), x.grad.float()))
    (picked, entropy, grad), (want_picked, want_entropy, want_grad) = results
    torch.testing.assert_close(picked, want_picked, rtol=0, atol=1e-4)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-4)
    torch.testing.assert_close(grad, want_grad, rtol=1e-2, atol=1e-5)
