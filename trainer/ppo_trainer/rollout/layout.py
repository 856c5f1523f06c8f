"""The token layout that rollout and training share: left-padded prompts, right-padded responses.

Prompts are left-padded to P so that every row's next token goes to the same column; position
ids count real tokens only (from the attention mask), so padding never shifts a row's positions
and a row's log-probs do not depend on how much it was padded. Depends on torch and the batch
records only (no model, no engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_trainer.batch import RolloutBatch
from ppo_trainer.rollout.base import Generation


def left_pad(prompts: Sequence[Sequence[int]], *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ([B, P] int64 ids, [B, P] int64 mask), P = the longest prompt."""
    if not prompts:
        raise ValueError("prompts is empty; pass at least one tokenized prompt")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:8]} have no tokens; every prompt needs at least one (e.g. BOS)")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] mask -> [B, L] positions: 0 at each row's first real token, counting real tokens only."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_rollout_batch(
    prompts_token_ids: Sequence[Sequence[int]],
    generation: Generation,
    scores: Sequence[float] | torch.Tensor,
    pad_id: int,
    *,
    prompts: list[str] | None = None,
    responses: list[str] | None = None,
) -> RolloutBatch:
    """The RolloutBatch of one generate call: [left-padded prompt | right-padded response] per row."""
    prompt_ids, prompt_mask = left_pad(prompts_token_ids, pad_id=pad_id)
    response_tokens = generation.response_tokens.to("cpu", torch.long)
    response_mask = generation.response_mask.to("cpu", torch.float32)
    if response_tokens.shape[0] != prompt_ids.shape[0]:
        raise ValueError(
            f"generation has {response_tokens.shape[0]} rows but there are {prompt_ids.shape[0]} prompts; "
            "pass the prompts that were generated from, in order"
        )
    score_tensor = torch.as_tensor(scores, dtype=torch.float32).reshape(-1).cpu()
    if score_tensor.shape[0] != prompt_ids.shape[0]:
        raise ValueError(
            f"scores has {score_tensor.shape[0]} entries; expected one per prompt ({prompt_ids.shape[0]})"
        )
    response_tokens = torch.where(
        response_mask.bool(), response_tokens, torch.full_like(response_tokens, pad_id)
    )
    return RolloutBatch(
        tokens=torch.cat([prompt_ids, response_tokens], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=response_mask,
        prompt_length=int(prompt_ids.shape[1]),
        rollout_log_probs=generation.log_probs.to("cpu", torch.float32) * response_mask,
        scores=score_tensor,
        prompts=list(prompts) if prompts is not None else [],
        responses=list(responses) if responses is not None else [],
    )
