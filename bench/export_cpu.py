"""How long a Hugging Face export takes and how large it is, on the CPU, through `ppo_trainer.export`.

For each model (default builtin:tiny and builtin:smollm2-135m) and dtype, the policy is built on the
CPU and exported with `write_export` (what an actor's rank 0 runs at a checkpoint.export step); the
export is then loaded with `AutoModelForCausalLM.from_pretrained`, its weights compared with the
policy's bit for bit and its logits on 64 tokens with the policy's. Prints one JSON line per export:
seconds to write and to load, bytes on disk, whether the weights are identical, the largest |logit
difference| (in bfloat16 not 0: the trainer's bf16 model holds its rotary frequencies in bf16,
transformers keeps them in float32).

    .venv/bin/python bench/export_cpu.py [--models builtin:tiny,builtin:smollm2-135m] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer"), str(ROOT / "api")]

from transformers import AutoModelForCausalLM

from ppo_trainer.export import export_source, write_export
from ppo_trainer.models import build_policy
from ppojob_api.spec import ModelSpec


def measure(path: str, dtype: str, out: Path) -> dict:
    spec = ModelSpec(path=path, dtype=dtype)
    policy = build_policy(spec, seed=0, device="cpu").eval()
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    directory = write_export(out / path.replace(":", "-") / dtype, policy.named_parameters(),
                             source=export_source(spec), dtype=policy.dtype)
    written = time.perf_counter() - started
    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(str(directory), dtype=policy.dtype).eval()
    load_seconds = time.perf_counter() - started
    held = loaded.state_dict()
    identical = all(torch.equal(held[name], weight) for name, weight in policy.state_dict().items())
    with torch.no_grad():
        difference = (loaded(input_ids=tokens).logits.float() - policy(input_ids=tokens).logits.float()).abs().max()
    return {"model": path, "dtype": dtype, "write_seconds": round(written, 3), "load_seconds": round(load_seconds, 3),
            "bytes": sum(f.stat().st_size for f in directory.iterdir()),
            "files": sorted(f.name for f in directory.iterdir()), "weights_identical": identical,
            "max_logit_difference": float(difference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="builtin:tiny,builtin:smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="export-bench-") as out:
        for path in args.models.split(","):
            for dtype in args.dtypes.split(","):
                print(json.dumps(measure(path, dtype, Path(out))), flush=True)


if __name__ == "__main__":
    main()
