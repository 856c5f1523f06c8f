"""A real SGLang server serves the trainer's Hugging Face export as it was trained.

The Torch backend's actor is built on the GPU from a random Qwen2.5-0.5B-shaped checkpoint (bf16),
its weights moved off the checkpoint's (a trained policy is not its source), and exported; the
server is started on the export directory, and what it samples is scored by the exported weights
(within bf16 round-off) and not by the source's. Needs sglang (the bundle on the GPU machine) and a
CUDA GPU; run with -s to see the figures.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("sglang", reason="needs sglang (bench/gpu_sglang_bundle.sh on the GPU machine)")

from test_sglang_server import (
    ATTENTION_BACKEND,
    EOS,
    MAX_LOG_RATIO,
    load_model,
    mismatch,
    model_dir,  # noqa: F401  (fixture)
    prompts,
    trainer_log_probs,
)

from ppo_trainer.backends.torch_backend import TorchBackend
from ppo_trainer.export import export_source, write_export
from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
from ppo_trainer.rollout.sglang.launcher import launch_engine_server
from ppojob_api.spec import ModelSpec, PPOJobSpec, RolloutSpec


def test_sglang_serves_the_export_of_a_trained_actor(model_dir, tmp_path):  # noqa: F811
    source = ModelSpec(path=str(model_dir), dtype="bfloat16")
    actor = TorchBackend(model_spec=source, role="actor", learning_rate=1e-3, max_grad_norm=1.0, device="cuda", seed=0)
    with torch.no_grad():  # "trained": every weight moved by far more than bf16 round-off
        for _, weight in actor.named_weights():
            weight.add_(torch.randn_like(weight) * 0.02)
    export = write_export(tmp_path / "final", actor.named_weights(), source=export_source(source),
                          dtype=torch.bfloat16)
    del actor
    torch.cuda.empty_cache()
    spec = PPOJobSpec(image="test", seed=1, model=ModelSpec(path=str(export), dtype="bfloat16"),
                      rollout=RolloutSpec(memory_fraction=0.5))
    server = launch_engine_server(spec, engine_index=0, host="127.0.0.1", log_dir=tmp_path / "logs", base_gpu_id=0,
                                  extra_args=ATTENTION_BACKEND, timeout_s=420)
    engine = SGLangRolloutEngine(servers=[server.client()], pad_token_id=EOS)
    try:
        rows = prompts(16, seed=7)
        out = engine.generate(rows, SamplingParams(max_new_tokens=32, temperature=1.0, seed=5))
    finally:
        engine.close()
        print(f"server log tail:\n{server.log_tail(8)}")
        server.stop()
    served = mismatch(trainer_log_probs(load_model(export), rows, out.response_tokens, out.response_mask),
                      out.log_probs, out.response_mask)
    untrained = mismatch(trainer_log_probs(load_model(model_dir), rows, out.response_tokens, out.response_mask),
                         out.log_probs, out.response_mask)
    print(f"served export: against the exported weights {served}, against the source's {untrained}")
    assert served["rollout_log_ratio_abs_max"] < MAX_LOG_RATIO
    assert untrained["rollout_log_ratio_abs_max"] > 10 * MAX_LOG_RATIO
