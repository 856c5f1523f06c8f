"""checkpoint.export through Ray on CPU: a short job writes the actor's and the critic's Hugging Face
directories every interval steps and at the end, its status names the last one, and what transformers
loads from the end's export gives the trained actor's log-probs and holds the trained critic's weights;
through the real CLI, the run's summary, events and last progress report name the export."""

from __future__ import annotations

import json
import time

import torch
import yaml
from cli_run import records, start
from role_state import role_weights
from trainer_specs import tiny_spec
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from ppo_trainer.batch import RolloutBatch
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.train import run_on


def probe_batch() -> RolloutBatch:
    """Rows of byte tokens, a prompt of 4 and a response of 6, the second row's response shorter."""
    g = torch.Generator().manual_seed(5)
    rows, prompt, response = 3, 4, 6
    mask = torch.ones(rows, response)
    mask[1, 3:] = 0
    tokens = torch.randint(0, 256, (rows, prompt + response), generator=g)
    tokens[:, 0] = 256  # BOS
    attention = torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask.long()], dim=1)
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=mask, prompt_length=prompt,
                        rollout_log_probs=torch.zeros(rows, response), scores=torch.zeros(rows))


def response_log_probs(model, batch: RolloutBatch) -> torch.Tensor:
    """[B, T] log-probs of the response tokens under a transformers causal LM, 0 past each response."""
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits.float()
    start, width = batch.prompt_length, batch.response_mask.shape[1]
    predicted = torch.log_softmax(logits[:, start - 1:start - 1 + width], dim=-1)
    chosen = predicted.gather(-1, batch.tokens[:, start:start + width, None]).squeeze(-1)
    return chosen * batch.response_mask


def test_export_every_interval_and_at_the_end_loads_with_the_trainer_s_log_probs(roles, tmp_path):
    spec = tiny_spec(ppo={"numRollouts": 3}, checkpoint={"export": {"interval": 2, "critic": True}})
    recorder = Recorder()
    started = time.perf_counter()
    state = run_on(roles, spec, reporter=recorder, checkpoint_dir=str(tmp_path / "checkpoints"))
    print(f"3 steps with 2 exports of actor and critic: {time.perf_counter() - started:.1f}s")
    root = tmp_path / "checkpoints" / "export"
    assert sorted(p.name for p in root.iterdir()) == ["critic", "final", "step-00000002"]
    assert sorted(p.name for p in (root / "critic").iterdir()) == ["final", "step-00000002"]
    final = root / "final"
    assert state.last_export["path"] == str(final)
    reported = recorder.progress[-1].to_status()["lastExport"]
    assert (reported["step"], reported["path"], reported["criticPath"]) == (3, str(final), str(root / "critic/final"))
    exports = [fields for kind, fields in recorder.events if kind == "export"]
    assert [e["path"] for e in exports] == [str(root / "step-00000002"), str(final)]
    print("export seconds:", [e["seconds"] for e in exports])

    batch = probe_batch()
    trainer = roles.actor.call(ActorWorker.log_probs, batch)[0]
    exported = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    torch.testing.assert_close(response_log_probs(exported, batch), trainer, atol=1e-5, rtol=0)
    earlier = AutoModelForCausalLM.from_pretrained(str(root / "step-00000002"), dtype=torch.float32).eval()
    assert (response_log_probs(earlier, batch) - trainer).abs().max() > 1e-4  # one more step trained since

    critic = AutoModelForTokenClassification.from_pretrained(str(root / "critic" / "final"), dtype=torch.float32)
    held = role_weights(roles.critic)
    loaded = critic.state_dict()
    assert set(held) == set(loaded)
    for name, tensor in held.items():
        assert torch.equal(loaded[name], tensor), name


def test_the_cli_run_s_summary_events_and_status_name_the_export(tmp_path):
    config, run_dir = tmp_path / "job.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump({"kind": "PPOJob", "metadata": {"name": "export"}, "spec": {
        "model": {"path": "builtin:tiny"}, "rollout": {"batchSize": 8, "maxNewTokens": 8},
        "ppo": {"numRollouts": 2}, "checkpoint": {"interval": 1, "export": {"interval": 1, "dtype": "bfloat16"}}}}))
    trainer = start(config, run_dir)
    out, _ = trainer.communicate(timeout=240)
    assert trainer.returncode == 0
    root = run_dir / "checkpoints" / "export"
    assert sorted(p.name for p in root.iterdir()) == ["final", "step-00000001"]
    assert json.loads((run_dir / "summary.json").read_text())["export"] == str(root / "final")
    lines = list(records(out.splitlines()))
    assert [r["path"] for r in lines if r["kind"] == "export"] == [str(root / "step-00000001"), str(root / "final")]
    last = [r for r in lines if r["kind"] == "progress"][-1]
    assert last["finished"] and (last["lastExport"]["step"], last["lastExport"]["path"]) == (2, str(root / "final"))
    assert "criticPath" not in last["lastExport"]
    loaded = AutoModelForCausalLM.from_pretrained(str(root / "final"))
    assert loaded.dtype == torch.bfloat16 and loaded.config.architectures == ["LlamaForCausalLM"]
