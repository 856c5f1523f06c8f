"""The trained models as Hugging Face directories, which transformers and inference servers load.

The actor is written as the causal LM it was built from (`AutoModelForCausalLM`), the critic as a
token classifier with one label (`AutoModelForTokenClassification`, num_labels=1: its logits
[B, L, 1] are the values; the trunk under `model.`, the value head as `score`). An export holds
`model.safetensors` (the backend's `named_weights()`, cast to the asked dtype), `config.json`
(the source model's, its dtype and architecture set), and for the actor `generation_config.json`
and the tokenizer's files, copied from the model's source directory (the random-init built-ins
have none: their ids are UTF-8 bytes). Before anything is written, the weights' names are checked
against the class that will load them, so an export either loads or is not written. A directory
appears whole or not at all: it is written into a temp sibling, fsynced and renamed into place (an
older one of the same name is moved aside first, then removed). Depends on torch, safetensors,
transformers and the model sources; not on Ray, the PPO loop or a backend.
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, GenerationConfig

from ppo_trainer.checkpoint import fsync_dir
from ppo_trainer.models import builtin_config, resolve_model_dir
from ppojob_api.spec import ModelSpec

WEIGHTS_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja")
"""The files a Hugging Face tokenizer is saved as (each copied when the source has it)."""
CRITIC_FOLDER = "critic"
"""The critic's exports live in <export path>/critic/, beside the actor's."""


class ExportError(RuntimeError):
    """The weights do not make the model they are exported as."""


def export_name(step: int | None) -> str:
    """The directory of the export after `step` steps (None: the end of the run)."""
    return "final" if step is None else f"step-{step:08d}"


@dataclass(frozen=True)
class ExportSource:
    """What an export copies besides the weights: the model's config and the files of its source."""

    config: object
    """The source model's transformers config (PretrainedConfig)."""
    model_dir: Path | None
    """The model's Hugging Face directory; None for a random-init built-in."""
    tokenizer_dir: Path | None
    """The tokenizer's directory; None for the built-in byte tokenizer."""
    value_model: bool = False
    """The critic: exported as a token classifier with one label, without generation config or tokenizer."""


def export_source(model: ModelSpec, *, tokenizer: str | None = None, value_model: bool = False) -> ExportSource:
    """The source of `model` (a role's model spec); `tokenizer`: the tokenizer path, by default the model's own."""
    model_dir = resolve_model_dir(model.path)
    config = builtin_config(model.path) if model_dir is None else AutoConfig.from_pretrained(str(model_dir))
    return ExportSource(config=config, model_dir=model_dir, value_model=value_model,
                        tokenizer_dir=resolve_model_dir(tokenizer or model.tokenizer or model.path))


def export_config(source: ExportSource, dtype: torch.dtype):
    """The config.json of the export, but for its architecture: the source's, with its dtype, and for
    the critic one label."""
    config = copy.deepcopy(source.config)
    config.dtype = dtype
    if source.value_model:
        config.num_labels = 1
    return config


def empty_model(config, *, value_model: bool):
    """The class that loads the export, built on the meta device (no memory), for its names."""
    auto = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def check_names(names: set[str], model) -> None:
    """`names` are the weights `model` loads: every one it expects, but for a tied copy (the output
    layer of a model with tied embeddings), and nothing else."""
    expected = set(model.state_dict())
    tied_copies = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()}
    missing, unexpected = sorted(expected - tied_copies - names), sorted(names - expected)
    if missing or unexpected:
        raise ExportError(f"the weights do not make a {type(model).__name__}: missing {missing[:5]},"
                          f" unexpected {unexpected[:5]} (of {len(missing)} and {len(unexpected)})")


def write_export(directory: str | Path, weights: Iterable[tuple[str, torch.Tensor]], *, source: ExportSource,
                 dtype: torch.dtype) -> Path:
    """Write the export of `weights` (Hugging Face names; on any device) into `directory`, atomically."""
    directory = Path(directory)
    config = export_config(source, dtype)
    loader = empty_model(config, value_model=source.value_model)
    config.architectures = [type(loader).__name__]
    tensors = {name: tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous() for name, tensor in weights}
    check_names(set(tensors), loader)
    directory.parent.mkdir(parents=True, exist_ok=True)
    temp = directory.parent / f".tmp-{directory.name}-{uuid.uuid4().hex[:8]}"
    temp.mkdir()
    try:
        save_file(tensors, str(temp / WEIGHTS_FILE), metadata={"format": "pt"})
        config.save_pretrained(str(temp))
        if not source.value_model:
            copy_generation_config(source, config, temp)
            if source.tokenizer_dir is not None:
                for name in TOKENIZER_FILES:
                    if (source.tokenizer_dir / name).is_file():
                        shutil.copyfile(source.tokenizer_dir / name, temp / name)
        for path in temp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(temp)
        replace_directory(temp, directory)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return directory


def copy_generation_config(source: ExportSource, config, directory: Path) -> None:
    """The source's generation_config.json, or one derived from the model's config (its special tokens)."""
    if source.model_dir is not None and (source.model_dir / GENERATION_CONFIG_FILE).is_file():
        shutil.copyfile(source.model_dir / GENERATION_CONFIG_FILE, directory / GENERATION_CONFIG_FILE)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(str(directory))


def replace_directory(temp: Path, directory: Path) -> None:
    """Rename `temp` to `directory`; an older `directory` is moved aside first, and removed once replaced."""
    old = None
    if directory.exists():
        old = directory.parent / f".old-{directory.name}-{uuid.uuid4().hex[:8]}"
        os.rename(directory, old)
    os.rename(temp, directory)
    fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
