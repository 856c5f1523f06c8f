"""Chat prompts from Parquet through the real CLI and Ray: a short run trains on a Parquet file of
{role, content} conversations with numeric labels and evaluates on another, with a chat model
(tests/tiny_chat_model.py: a random-init Llama whose tokenizer has a ChatML template).

The run's reward is a custom function in a file the test writes: it records every (prompt, label)
it is given, so the test sees that every row reached the rollout engines, each with its own label,
and that nothing else did."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from cli_run import records
from tests.fixtures.tiny_chat_model import write_chat_model

STEPS, SAMPLES, ROWS, HELD_OUT = 2, 8, 12, 5
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))

RECORDING_REWARD = '''
import json

def score(prompts, responses, labels):
    with open("{seen}", "a") as f:
        for prompt, label in zip(prompts, labels):
            f.write(json.dumps([prompt, label]) + "\\n")
    return [float(r.count("a")) / max(len(r), 1) for r in responses]
'''


def write_chat_parquet(path, first: int, count: int) -> list[tuple[str, str]]:
    """`count` conversations (every other one with a system message) and integer labels; their
    (readable text, label) pairs."""
    conversations, labels, expected = [], [], []
    for n in range(first, first + count):
        question = {"role": "user", "content": f"What is {n} + {n}?"}
        conversation = [{"role": "system", "content": "Reply with the number."}, question] if n % 2 else [question]
        conversations.append(conversation)
        labels.append(2 * n)
        expected.append(("\n".join(f"{m['role']}: {m['content']}" for m in conversation), str(2 * n)))
    pq.write_table(pa.table({"messages": pa.array(conversations, MESSAGES), "answer": pa.array(labels, pa.int64())}),
                   path)
    return expected


def test_a_run_trains_and_evaluates_on_parquet_chat_prompts(tmp_path):
    model = write_chat_model(tmp_path / "chat-model")
    training = write_chat_parquet(tmp_path / "train.parquet", 0, ROWS)
    held_out = write_chat_parquet(tmp_path / "test.parquet", 100, HELD_OUT)
    seen = tmp_path / "seen.jsonl"
    reward = tmp_path / "recording_reward.py"
    reward.write_text(RECORDING_REWARD.replace("{seen}", str(seen)))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(model)}, "seed": 1, "ppo": {"numRollouts": STEPS},
        "rollout": {"batchSize": SAMPLES, "maxNewTokens": 4}, "actor": {"microBatchSize": SAMPLES},
        "checkpoint": {"interval": 0}, "reward": {"type": "Custom", "function": f"{reward}:score"},
        "data": {"prompts": str(tmp_path / "train.parquet"), "promptKey": "messages", "labelKey": "answer",
                 "validation": {"prompts": str(tmp_path / "test.parquet")}},
    }))
    args = [sys.executable, "-m", "ppo_trainer.cli", str(config), "--run-dir", str(tmp_path / "run"), "--json",
            "--object-store-mb", "200"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]

    steps = [r for r in records(result.stdout.splitlines()) if r["kind"] == "step"]
    assert len(steps) == STEPS and all(s["samples"] == SAMPLES for s in steps)
    assert steps[-1]["eval_samples"] == HELD_OUT
    pairs = [tuple(json.loads(line)) for line in seen.read_text().splitlines()]
    # The first step's 8 and the second's 8 samples come from one epoch of 12 rows and the next's
    # first 4; then the held-out rows once each.
    trained, evaluated = pairs[: STEPS * SAMPLES], pairs[STEPS * SAMPLES:]
    assert len(trained) == STEPS * SAMPLES and set(trained) == set(training)
    assert sorted(evaluated) == sorted(held_out)
