"""A reward model's score as a `Reward`: a Hugging Face sequence classifier, one score per (prompt, response).

`RewardModel` holds the classifier (`AutoModelForSequenceClassification`, one label) on a device
with its own tokenizer, which may differ from the policy's: each (prompt, response) is rendered
again for it, with its chat template when it has one (a user turn, then an assistant turn), else
as the prompt followed by the response; a sequence longer than `max_length` keeps its end, where
the score is read. It parks its weights in host memory through the one mover (`HostMirror`).
`ModelReward` combines the weighted score with an optional rule-based reward (`combine_scores`).
`check_reward_model` reads a directory's config and tokenizer without loading the weights, before
Ray starts. torch and transformers are imported here only; nothing depends on Ray or the PPO loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_trainer.rewards import Reward
from ppojob_api.vocabulary import RewardCombine


class RewardModelError(ValueError):
    """reward.model.path does not hold a sequence-classification model with one label and its tokenizer."""


def check_reward_model(path: str) -> None:
    """Raise `RewardModelError` unless `path` is a local directory whose config is a sequence
    classifier with num_labels 1 and which holds a tokenizer (the weights are not read)."""
    from transformers import AutoConfig, AutoTokenizer

    where = f"reward.model.path {path!r}"
    if not (Path(path) / "config.json").is_file():
        raise RewardModelError(f"{where} is not a Hugging Face model directory (no config.json): give a local"
                               " directory written by save_pretrained of an AutoModelForSequenceClassification")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RewardModelError(f"{where}: its config.json does not load ({first_line}); fix it or give another"
                               " directory") from None
    architectures = config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise RewardModelError(f"{where} holds a {', '.join(architectures) or config.model_type} model, not a"
                               " sequence classifier: give a model saved as AutoModelForSequenceClassification")
    if config.num_labels != 1:
        raise RewardModelError(f"{where} scores {config.num_labels} labels; a reward model gives one score per"
                               " sequence: give a model with num_labels 1")
    try:
        AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RewardModelError(f"{where} holds no tokenizer that loads ({first_line}): save the reward model's"
                               " tokenizer beside it (tokenizer.save_pretrained)") from None


def render(tokenizer: Any, prompt: str, response: str) -> list[int]:
    """The token ids the reward model reads for one (prompt, response): its chat template's rendering
    of a user turn and an assistant turn when it has a template, else prompt + response as text (with
    the tokenizer's own special tokens, e.g. BOS)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt + response, add_special_tokens=True))


def keep_end(ids: list[int], max_length: int) -> list[int]:
    """The last `max_length` ids: a classifier reads its score at the end of the sequence."""
    return ids[-max_length:] if len(ids) > max_length else ids


def combine_scores(model_scores: list[float], rule_scores: list[float] | None, *, weight: float,
                   combine: RewardCombine) -> list[float]:
    """weight * model score, met with the rule's score of the same sample (None: no rule, the weighted
    score alone). Sum: added to it. Gate: kept where the rule's score is above 0; elsewhere the rule's
    score stands (a failed rule is not bought back by the model)."""
    weighted = [weight * score for score in model_scores]
    if rule_scores is None:
        return weighted
    if len(rule_scores) != len(weighted):
        raise ValueError(f"{len(rule_scores)} rule scores for {len(weighted)} model scores; expected one each")
    if combine == RewardCombine.SUM:
        return [w + r for w, r in zip(weighted, rule_scores)]
    return [w if r > 0 else r for w, r in zip(weighted, rule_scores)]


class RewardModel:
    """A sequence classifier with one label on a device, its tokenizer, and its weights' parking."""

    def __init__(self, path: str, *, device: str, dtype: str, micro_batch_size: int, max_length: int) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from ppo_trainer.models.builtin import resolve_dtype
        from ppo_trainer.offload.host_mirror import HostMirror

        check_reward_model(path)
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=resolve_dtype(dtype), local_files_only=True
        )
        pad = model.config.pad_token_id
        if pad is None:  # transformers reads the score at the last token that is not this one
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            model.config.pad_token_id = 0 if pad is None else pad
        self.pad_token_id = model.config.pad_token_id
        self.model = model.to(self.device).eval()
        self._mirror = HostMirror(device=self.device)

    def encode(self, prompts: list[str], responses: list[str]) -> list[list[int]]:
        """Each (prompt, response) as the reward model reads it: rendered, then cut to its last max_length tokens."""
        return [keep_end(render(self.tokenizer, p, r), self.max_length) for p, r in zip(prompts, responses, strict=True)]

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """The model's score of each (prompt, response), `micro_batch_size` sequences per forward pass."""
        import torch

        sequences = self.encode(prompts, responses)
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(sequences), self.micro_batch_size):
                part = sequences[start : start + self.micro_batch_size]
                longest = max(len(ids) for ids in part)
                ids = torch.full((len(part), longest), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(part), longest), dtype=torch.long)
                for row, tokens in enumerate(part):  # right-padded: each row's positions are its own
                    ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                    mask[row, : len(tokens)] = 1
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                scores.extend(logits[:, 0].float().cpu().tolist())
        return scores

    def sleep(self) -> None:
        """Weights to host memory (pinned on CUDA), their device memory given back."""
        self._move_weights(to_host=True)

    def wake_up(self) -> None:
        """Weights back on the device."""
        self._move_weights(to_host=False)

    def _move_weights(self, *, to_host: bool) -> None:
        import torch

        tensors = [*self.model.parameters(), *self.model.buffers()]
        move = self._mirror.to_host if to_host else self._mirror.to_device
        with torch.no_grad():
            move([t.data for t in tensors], lambda index, moved: setattr(tensors[index], "data", moved),
                 direction="sleep" if to_host else "wake_up")


@dataclass(frozen=True, kw_only=True)
class ModelReward(Reward):
    """A reward model's weighted score, alone or combined with a rule-based reward (`combine_scores`)."""

    model: RewardModel
    rule: Reward | None = None
    """The rule-based reward scored beside the model (reward.model.combineWith)."""
    weight: float = 1.0
    combine: RewardCombine = RewardCombine.SUM

    def score(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        self._check_lengths(prompts, responses, labels)
        rule_scores = None if self.rule is None else self.rule.score(prompts, responses, labels)
        return combine_scores(self.model.score(prompts, responses), rule_scores, weight=self.weight,
                              combine=self.combine)
