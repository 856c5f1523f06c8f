"""Where a model path leads: a built-in configuration, the converted SmolLM2 directory, or a local directory.

`builtin:tiny` (2 layers x 64 wide) and `builtin:tiny-narrow` (1 layer x 32 wide, a smaller
critic for the tiny policy) are random-init Llamas over the byte tokenizer's vocabulary, small
enough to train on a CPU in seconds; `builtin:smollm2-135m` is the converted SmolLM2 directory;
anything else is a local Hugging Face directory (nothing is downloaded). Both the model builders
and the tokenizer loader read paths here, so neither imports the other. Depends on the standard
library only (and `models/smollm.py` for its directory).
"""

from __future__ import annotations

from pathlib import Path

TINY = "builtin:tiny"
TINY_NARROW = "builtin:tiny-narrow"
SMOLLM2 = "builtin:smollm2-135m"
RANDOM_BUILTINS = (TINY, TINY_NARROW)
"""Random-init built-ins: a configuration in `models/builtin.py`, no directory."""
BUILTINS = (*RANDOM_BUILTINS, SMOLLM2)


def resolve_model_dir(path: str) -> Path | None:
    """The Hugging Face directory behind a model path; None for the random-init built-ins (no directory)."""
    if path in RANDOM_BUILTINS:
        return None
    if path == SMOLLM2:
        from ppo_trainer.models.smollm import ensure_smollm2

        return ensure_smollm2()
    if path.startswith("builtin:"):
        raise ValueError(f"model path {path!r} is not a built-in model; use one of {', '.join(BUILTINS)}")
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"model path {path!r} is not a Hugging Face model directory (no config.json); "
            f"give a local directory written by save_pretrained, or one of {', '.join(BUILTINS)}"
        )
    return directory
