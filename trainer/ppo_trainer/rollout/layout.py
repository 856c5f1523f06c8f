"""The token layout that rollout and training share: left-padded prompts, right-padded responses.

Prompts are left-padded to P so that every row's next token goes to the same column; position
ids count real tokens only (from the attention mask), so padding never shifts a row's positions
and a row's log-probs do not depend on how much it was padded; `merge_batches` joins the engines'
parts into the step's batch, re-padded the same way. Training passes re-lay rows out
(`aligned_rows`): each row's real tokens start at column 0, so plain causal attention needs no
padding mask (and takes the fused attention kernels). Depends on torch and the batch records only
(no model, no engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def merge_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """One batch from the engines' parts: prompts re-padded on the left, responses on the right.

    New padding holds token 0 with attention mask 0, so no model ever attends to it."""
    if len(parts) == 1:
        return parts[0]
    prompt_len = max(p.prompt_length for p in parts)
    response_len = max(p.response_length for p in parts)

    def pad(part: RolloutBatch, tensor: torch.Tensor, value: float, sequence: bool) -> torch.Tensor:
        if not sequence:
            return F.pad(tensor, (0, response_len - part.response_length), value=value)
        left, right = prompt_len - part.prompt_length, response_len - part.response_length
        return F.pad(tensor, (left, right), value=value)

    return RolloutBatch(
        tokens=torch.cat([pad(p, p.tokens, 0, True) for p in parts]),
        attention_mask=torch.cat([pad(p, p.attention_mask, 0, True) for p in parts]),
        response_mask=torch.cat([pad(p, p.response_mask, 0.0, False) for p in parts]),
        prompt_length=prompt_len,
        rollout_log_probs=torch.cat([pad(p, p.rollout_log_probs, 0.0, False) for p in parts]),
        scores=torch.cat([p.scores for p in parts]),
        prompts=[text for p in parts for text in p.prompts],
        responses=[text for p in parts for text in p.responses],
    )


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


@dataclass(frozen=True)
class AlignedRows:
    """Rows of a RolloutBatch re-laid out for a training pass, on CPU.

    Row b holds its real prompt tokens, then its response, from column 0 on; columns past them
    hold token 0, which causal attention never lets a real token see. Positions are the column
    numbers. The output at column `predict_at[b, t]` (prompt length - 1 + t) predicts response
    token t, and is the state the critic values before that token.
    """

    input_ids: torch.Tensor
    """[b, W] int64."""
    predict_at: torch.Tensor
    """[b, kept] int64: the column whose output belongs to response token t."""
    targets: torch.Tensor
    """[b, kept] int64: the response tokens (padding where the response ended)."""
    real: torch.Tensor
    """[b, kept] bool: the response mask."""

    @property
    def kept(self) -> int:
        return int(self.targets.shape[1])

    def real_outputs(self) -> torch.Tensor:
        """[n] int64: for each real response token (row by row), the row of the model's outputs
        flattened to [b * W] that predicts it; one `index_select` picks them all."""
        flat = torch.arange(self.input_ids.shape[0])[:, None] * self.input_ids.shape[1] + self.predict_at
        return flat[self.real]


def aligned_rows(batch: RolloutBatch, rows: torch.Tensor, *, width_multiple: int = 1) -> AlignedRows:
    """Rows `rows` of `batch`, each row's real tokens moved to start at column 0.

    Responses are cut to the longest one among these rows (`kept` columns; at least 1); the last
    response token is never an input. W is rounded up to a multiple of `width_multiple`, so that
    compiled kernels see few distinct shapes.
    """
    if width_multiple < 1:
        raise ValueError(f"width_multiple must be >= 1, got {width_multiple}")
    p = batch.prompt_length
    attention = batch.attention_mask[rows]
    prompt_lengths = attention[:, :p].sum(dim=1)
    response_lengths = attention[:, p:].sum(dim=1)
    kept = max(1, int(response_lengths.max()))
    width = int(prompt_lengths.max()) + kept - 1
    width = -(-width // width_multiple) * width_multiple
    columns = torch.arange(width)
    source = ((p - prompt_lengths)[:, None] + columns[None, :]).clamp(max=batch.tokens.shape[1] - 1)
    real_tokens = columns[None, :] < (prompt_lengths + response_lengths)[:, None]
    input_ids = torch.where(real_tokens, batch.tokens[rows].gather(1, source), 0)
    return AlignedRows(
        input_ids=input_ids,
        predict_at=(prompt_lengths - 1)[:, None] + torch.arange(kept)[None, :],
        targets=batch.tokens[rows, p : p + kept],
        real=batch.response_mask[rows, :kept].bool(),
    )
