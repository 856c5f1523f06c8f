"""How far one PPO update moves when the batch is split differently: micro-batches and data-parallel ranks.

On the CPU, with builtin:tiny and a seeded batch of ragged responses (the defaults: 32 rows,
advantage whitening on), the actor's and the critic's gradient of one training step is taken for
each split (ranks x micro-batch size) through the product's role classes (ActorWorker,
CriticWorker: their targets, whitening, losses and backends); several ranks run as processes of
one gloo group, as in a real run. Each gradient is compared with the one of a single rank on the
whole batch as one micro-batch: the printed figure is ||g - g_whole|| / ||g_whole||. A loss that
does not depend on the split prints float32 round-off (about 1e-7).

    .venv/bin/python bench/split_invariance.py [--splits 1x32,1x8,1x4,1x1,2x8,2x1,8x4,8x1] [--aggregation TokenMean]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer"), str(ROOT / "api")]

from ppo_trainer.batch import RolloutBatch
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.critic import CriticWorker
from ppojob_api.spec import parse_spec

ROWS, RESPONSE, PAD = 32, 16, 258


def ragged_batch(rows: int = ROWS, seed: int = 0) -> RolloutBatch:
    """Prompts of 2-7 tokens, responses of 1-16 tokens (uniform), random scores."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, RESPONSE + 1, (rows,), generator=g)
    prompt_lengths = torch.randint(2, 8, (rows,), generator=g)
    width = int(prompt_lengths.max())
    tokens = torch.full((rows, width + RESPONSE), PAD)
    attention = torch.zeros(rows, width + RESPONSE, dtype=torch.long)
    mask = torch.zeros(rows, RESPONSE)
    for row in range(rows):
        p, n = int(prompt_lengths[row]), int(lengths[row])
        tokens[row, width - p : width] = torch.randint(0, 256, (p,), generator=g)
        tokens[row, width : width + n] = torch.randint(0, 256, (n,), generator=g)
        attention[row, width - p : width + n] = 1
        mask[row, :n] = 1.0
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=mask, prompt_length=width,
                        rollout_log_probs=torch.zeros(rows, RESPONSE), scores=torch.rand(rows, generator=g))


def make_spec(micro_batch_size: int, aggregation: str | None):
    ppo = {"numRollouts": 1, "epochs": 1, "klCoef": 0.05}
    if aggregation:
        ppo["lossAggregation"] = aggregation
    return parse_spec({"image": "local", "seed": 1, "model": {"path": "builtin:tiny"},
                       "actor": {"learningRate": 1e-2, "microBatchSize": micro_batch_size, "maxGradNorm": 0.0},
                       "ppo": ppo})


def captured_gradient(worker) -> list:
    """Replace the optimizer step by recording the reduced gradient it would have applied."""
    captured: list = []

    def record():
        captured.append(torch.cat([p.grad.reshape(-1).clone() for p in worker.backend.model.parameters()]))

    worker.backend.optimizer.step = record
    return captured


def one_step(rank: int, world: int, micro_batch_size: int, aggregation: str | None, rendezvous) -> dict:
    """Rank `rank` of `world`: the critic's and the actor's gradient of one step on the shared batch."""
    torch.set_num_threads(1)
    spec = make_spec(micro_batch_size, aggregation)
    batch = ragged_batch()
    g = torch.Generator().manual_seed(1)
    ref_noise = 0.1 * torch.randn(batch.response_mask.shape, generator=g)
    # Offloaded between turns, as in a run: each turn builds the role's group and destroys it, so
    # the two roles of this process take turns being its default group.
    workers = {cls.role: cls(spec, rank=rank, world_size=world, device="cpu", offload=True)
               for cls in (ActorWorker, CriticWorker)}
    for worker in workers.values():
        if world > 1:
            address = worker.host_process_group("127.0.0.1") if rank == 0 else None
            address = rendezvous(worker.role, address)
            worker.join_process_group(*address)
    actor, critic = workers["actor"], workers["critic"]
    shard_rows = torch.arange(rank, batch.size, world)
    old = actor.log_probs(batch)
    ref = old + ref_noise[shard_rows] * batch.response_mask[shard_rows]
    critic_grads = captured_gradient(critic)
    # Both roles have `world` data ranks: rank r's samples are the same rows in each, so the critic
    # takes rank r's log-probs and the actor rank r's values.
    values, _ = critic.train(batch, old, ref, actor_data_size=world, updates=1)
    actor_grads = captured_gradient(actor)
    actor.train(batch, values, old_log_probs=old, ref_log_probs=ref)
    return {"actor": actor_grads[0], "critic": critic_grads[0]}


def _rank_main(rank, world, micro_batch_size, aggregation, queues, results):
    def rendezvous(role, address):
        if rank == 0:
            for q in queues[1:]:
                q.put(address)
            return address
        return queues[rank].get()

    out = one_step(rank, world, micro_batch_size, aggregation, rendezvous)
    if rank == 0:
        results.put({k: v.numpy() for k, v in out.items()})


def gradients(world: int, micro_batch_size: int, aggregation: str | None) -> dict:
    if world == 1:
        return one_step(0, 1, micro_batch_size, aggregation, None)
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(world)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, micro_batch_size, aggregation, queues, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out = results.get()
    for p in procs:
        p.join()
    return {k: torch.from_numpy(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", default="1x32,1x8,1x4,1x1,2x8,2x1,8x4,8x1",
                        help="comma-separated RANKSxMICRO_BATCH; the first is the reference")
    parser.add_argument("--aggregation", default=None, help="ppo.lossAggregation (left unset: the default)")
    args = parser.parse_args()
    splits = [tuple(int(n) for n in s.split("x")) for s in args.splits.split(",")]
    reference = gradients(*splits[0], args.aggregation)
    rows = []
    for world, micro in splits[1:]:
        grads = gradients(world, micro, args.aggregation)
        row = {"ranks": world, "microBatch": micro}
        for role in ("actor", "critic"):
            row[role] = float((grads[role] - reference[role]).norm() / reference[role].norm())
        rows.append(row)
        print(f"{world} rank(s) x micro-batch {micro:2d}: actor {row['actor']:.2e}  critic {row['critic']:.2e}",
              flush=True)
    print(json.dumps({"reference": f"{splits[0][0]}x{splits[0][1]}", "aggregation": args.aggregation,
                      "relativeGradientDifference": rows}))


if __name__ == "__main__":
    main()
