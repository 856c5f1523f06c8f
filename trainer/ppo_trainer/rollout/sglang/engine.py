"""`SGLangRolloutEngine`: the RolloutEngine protocol over one or more running SGLang servers.

`generate` sends the token prompts to the router when there is one (one request per prompt, so
that it balances them), else splits them over the servers in contiguous batched shards sent in
parallel, and turns the answers (`output_ids`,
`meta_info.output_token_logprobs`) into a right-padded `Generation`. SGLang's returned
log-probs are those of the sampled token under logits / temperature (under the raw logits when
greedy), the same convention as the built-in engine, provided SGLANG_RETURN_ORIGINAL_LOGPROB is
unset on the servers. `update_weights` loads tensors held by this process (/update_weights_from_tensor
with CUDA IPC handles: the object-store path). The engine is a `ServedEngine`: over a weight-update
group its servers take the weights themselves (`weight_sync/broadcast.py:ServerReceiver`).
`sleep`/`wake_up` release and resume the servers' memory, idempotently. A failing server
raises `RolloutServerError` naming the server and the call, after the client's bounded
retries. Depends on torch and the client; never imports sglang, never launches anything.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

from ppo_trainer.offload import Residency, Transition
from ppo_trainer.rollout.base import Generation, SamplingParams
from ppo_trainer.rollout.sglang.client import RolloutServerError, SGLangClient

ROUTER_CONCURRENCY = 64
"""Requests in flight at once through the router (one per prompt, so that it can balance them)."""


def prompt_seed(seed: int, index: int) -> int:
    """The per-request `sampling_seed` of prompt `index` in a call seeded `seed` (distinct per prompt)."""
    return (seed * 1_000_003 + index) % (2**31 - 1)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One /update_weights_from_tensor payload: the (name, tensor) list pickled by torch's
    ForkingPickler (CUDA tensors travel as IPC handles, so sender and server share the GPU), base64."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()


class SGLangRolloutEngine:
    """Rollout over `servers` (one client per server, each serving `tensor_parallel` GPUs)."""

    def __init__(
        self,
        *,
        servers: list[SGLangClient],
        pad_token_id: int,
        tensor_parallel: int = 1,
        router: SGLangClient | None = None,
        listener: Callable[[Transition], None] | None = None,
    ) -> None:
        if not servers:
            raise ValueError("SGLangRolloutEngine needs at least one server")
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        self.servers = list(servers)
        self.router = router
        self.pad_token_id = int(pad_token_id)
        self.tensor_parallel = tensor_parallel
        self.residency = Residency.for_rollout("rollout", listener=listener)
        self._pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="sglang")

    # --- RolloutEngine ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        self.residency.require_awake("generate")
        if not prompts:
            raise ValueError("prompts is empty; pass at least one tokenized prompt")
        sampling = [
            {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "sampling_seed": prompt_seed(params.seed, i),
            }
            for i in range(len(prompts))
        ]
        if self.router is not None:
            with ThreadPoolExecutor(max_workers=min(len(prompts), ROUTER_CONCURRENCY)) as pool:
                answers = list(pool.map(self.router.generate_one, prompts, sampling))
            results = self._parse(self.router, answers)
        else:
            shards = _shard(len(prompts), len(self.servers))
            futures = [
                self._pool.submit(server.generate, prompts[lo:hi], sampling[lo:hi])
                for server, (lo, hi) in zip(self.servers, shards)
                if hi > lo
            ]
            used = [server for server, (lo, hi) in zip(self.servers, shards) if hi > lo]
            results = [row for server, f in zip(used, futures) for row in self._parse(server, f.result())]
        return self._to_generation(results)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Colocated: hand the tensors to every server by CUDA IPC (/update_weights_from_tensor).

        The tensors must live on the GPU the server shares with this process; CPU tensors are
        moved to the current CUDA device first. The servers pause, load, flush and continue
        (continue also after a failure, which is raised).
        """
        device = "cuda" if torch.cuda.is_available() else None
        named = [(name, t.detach().to(device) if device else t.detach()) for name, t in named_tensors]
        payload = serialize_named_tensors(named)
        self._on_all("pause_generation")
        try:
            self._on_all(
                "update_weights_from_tensor",
                serialized_named_tensors=[payload] * self.tensor_parallel,
                flush_cache=False,
            )
            self._on_all("flush_cache")
        except BaseException:
            # The failure is what the step reports; the servers must still not stay paused.
            self._on_all("continue_generation", quiet=True)
            raise
        self._on_all("continue_generation")

    def sleep(self) -> None:
        """Release the servers' weights and KV cache (no-op when asleep)."""
        self.residency.sleep(lambda: self._on_all("release_memory_occupation"))

    def wake_up(self) -> None:
        """Resume the servers' memory; weights come back from their CPU backup (no-op when awake)."""
        self.residency.wake(lambda: self._on_all("resume_memory_occupation"))

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    # --- helpers -----------------------------------------------------------------------------------

    def _on_all(self, method: str, *, quiet: bool = False, **kwargs: Any) -> None:
        """Call `method` on every server at once; raise the first failure unless `quiet`."""
        futures = [self._pool.submit(getattr(server, method), **kwargs) for server in self.servers]
        errors = [f.exception() for f in futures]
        if not quiet:
            _first_error(errors)

    def _parse(self, server: SGLangClient, results: list[dict]) -> list[tuple[list[int], list[float]]]:
        rows = []
        for i, result in enumerate(results):
            meta = result.get("meta_info") or {}
            finish = meta.get("finish_reason") or {}
            if isinstance(finish, dict) and finish.get("type") == "abort":
                raise RolloutServerError(
                    server=server.url, call="/generate", reason=f"request {i} was aborted: {finish.get('message')}"
                )
            tokens = [int(t) for t in result.get("output_ids") or []]
            pairs = meta.get("output_token_logprobs")
            if pairs is None or len(pairs) != len(tokens) or any(int(p[1]) != t for p, t in zip(pairs, tokens)):
                raise RolloutServerError(
                    server=server.url,
                    call="/generate",
                    reason=f"result {i}: output_token_logprobs do not match output_ids (return_logprob ignored?)",
                )
            rows.append((tokens, [float(p[0]) for p in pairs]))
        return rows

    def _to_generation(self, rows: list[tuple[list[int], list[float]]]) -> Generation:
        width = max(1, max(len(tokens) for tokens, _ in rows))
        tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
        for row, (ids, lps) in enumerate(rows):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1.0
            log_probs[row, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        return Generation(response_tokens=tokens, response_mask=mask, log_probs=log_probs)


def _shard(count: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges splitting `count` items into `parts` contiguous shards, sizes differing by at most one."""
    size, extra = divmod(count, parts)
    bounds, lo = [], 0
    for part in range(parts):
        hi = lo + size + (1 if part < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _first_error(errors: list[BaseException | None]) -> None:
    for error in errors:
        if error is not None:
            raise error
