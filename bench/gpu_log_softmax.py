"""The output layer's log-softmax, log-probs and entropies over one chunk of logits, forward and
backward, on one GPU: the fused kernels the trainer runs (`algorithms/log_softmax_kernel.py`)
against `torch.compile` and eager PyTorch of the same arithmetic (`ppo._log_softmax_chunk`), and
against a memory-traffic floor (a copy of the bytes each pass must move at least: the forward
reads the logits once, the backward reads them and writes their gradient).
`python3 bench/gpu_log_softmax.py [--rows 2048 --vocab 151936]`
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("trainer", "api")]
from ppo_trainer.algorithms.log_softmax_kernel import fused_log_softmax
from ppo_trainer.algorithms.ppo import _log_softmax_chunk


def timed_ms(fn, repeats: int = 10) -> float:
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=generator, device="cuda") * 3).to(torch.bfloat16)
    tokens = torch.randint(0, args.vocab, (args.rows,), generator=generator, device="cuda")
    gradient = torch.randn(2, args.rows, generator=generator, device="cuda")
    nbytes = logits.nbytes
    scratch = torch.empty_like(logits)
    floor_read = timed_ms(lambda: scratch.copy_(logits)) / 2  # a copy reads and writes: half of it
    print(f"{args.rows} x {args.vocab} bf16 logits ({nbytes / 1e9:.2f} GB); one read of them at copy speed"
          f" {floor_read:.3f} ms ({nbytes / floor_read / 1e6:.0f} GB/s)")
    print(f"{'':<26}{'forward ms':>11}{'fwd+bwd ms':>12}{'x the floor':>12}")
    for name, fn in (("fused kernels", fused_log_softmax),
                     ("torch.compile", torch.compile(_log_softmax_chunk, dynamic=True)),
                     ("eager", _log_softmax_chunk)):
        x = logits.detach().requires_grad_()

        def forward(fn=fn):
            with torch.no_grad():
                fn(logits, tokens, 1.0, True)

        def both(fn=fn, x=x):
            picked, entropy = fn(x, tokens, 1.0, True)
            torch.autograd.backward((picked, entropy), tuple(gradient))
            x.grad = None  # as a training pass's chunk: its gradient goes on to the output layer, not summed here

        forward_ms, both_ms = timed_ms(forward), timed_ms(both)
        print(f"{name:<26}{forward_ms:>11.3f}{both_ms:>12.3f}{both_ms / (3 * floor_read):>12.2f}", flush=True)


if __name__ == "__main__":
    main()
