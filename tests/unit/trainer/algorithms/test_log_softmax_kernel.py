"""The fused log-softmax kernels (`algorithms/log_softmax_kernel.py`), run by Triton's interpreter
on the CPU: log-probs, entropies and the logits' gradient against the float64 formulas. The
interpreter is chosen when Triton is first imported, so the cases run in a process of their own.
The GPU run of the same kernels: tests/gpu/test_output_layer.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


def check_every_case() -> None:
    from ppo_trainer.algorithms.log_softmax_kernel import BLOCK, fused_log_softmax
    from ppo_trainer.algorithms.ppo import entropy_from_logits, log_probs_from_logits

    for vocab in (300, BLOCK + 77):  # within one block, across two
        for temperature in (1.0, 0.7):
            for with_entropy in (True, False):
                generator = torch.Generator().manual_seed(vocab)
                logits = (torch.randn(5, vocab, generator=generator) * 4).requires_grad_()
                tokens = torch.randint(0, vocab, (5,), generator=generator)
                a, b = torch.randn(2, 5, generator=generator, dtype=torch.float64)
                picked, entropy = fused_log_softmax(logits, tokens, temperature, with_entropy)
                exact = logits.detach().double().requires_grad_()
                want_picked = log_probs_from_logits(exact / temperature, tokens)
                want_entropy = entropy_from_logits(exact / temperature)
                torch.testing.assert_close(picked.double(), want_picked, rtol=0, atol=1e-5)
                objective, want_objective = (picked * a).sum(), (want_picked * a).sum()
                if with_entropy:
                    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=1e-5)
                    objective, want_objective = objective + (entropy * b).sum(), want_objective + (want_entropy * b).sum()
                elif entropy.any() or entropy.requires_grad:
                    raise AssertionError("without entropy the kernel must return constant zeros")
                (grad,) = torch.autograd.grad(objective, logits)
                (want,) = torch.autograd.grad(want_objective, exact)
                torch.testing.assert_close(grad.double(), want, rtol=0, atol=1e-5)
                print(f"vocab {vocab}, temperature {temperature}, entropy {with_entropy}: ok", flush=True)


def test_the_fused_kernels_give_the_formulas_values_and_gradient():
    root, here = Path(__file__).resolve().parents[4], Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "trainer"), str(root / "api"), str(here)])}
    run = subprocess.run([sys.executable, "-c", "import test_log_softmax_kernel as t; t.check_every_case()"],
                         check=False, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ok") == 8, run.stdout
