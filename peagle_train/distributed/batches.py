"""Dealing one optimizer step's sequences to ranks and micro-batches (length-balanced)."""
from __future__ import annotations


def rank_batches(chunk: list[int], lengths: list[int], world: int, rank: int, micro_batch_size: int,
                 grad_accum: int, balance: bool = True) -> list[list[int]]:
    """This rank's micro-batches (sequence indices) for one optimizer step.

    Args:
        chunk: the step's ``world × grad_accum × micro_batch_size`` sequence indices, in shuffled order.
        lengths: token length of every sequence (indexed by sequence id).
        world, rank: process group. micro_batch_size, grad_accum: per rank.
        balance: deal by length (longest first, each to the rank with the fewest tokens that still has
            room; ties → lower rank) instead of contiguous slices of ``chunk``.

    Returns:
        ``grad_accum`` lists of ``micro_batch_size`` indices. Over all ranks every index of
        ``chunk`` appears exactly once; the result depends only on the arguments.

    Example: chunk ``[0, 1, 2, 3]``, lengths ``[10, 40, 30, 20]``, world 2, one sequence per
    micro-batch, 2 micro-batches: by length 1(40) → r0, 2(30) → r1, 3(20) → r1 (r1 has 30 < 40),
    0(10) → r0; rank 0 gets ``[[1], [0]]`` (50 tokens), rank 1 ``[[2], [3]]`` (50 tokens).
    """
    per_rank = micro_batch_size * grad_accum
    if len(chunk) != per_rank * world:
        raise ValueError(f"chunk has {len(chunk)} indices, expected {per_rank * world}")
    if balance:
        load, mine_of = [0] * world, [[] for _ in range(world)]
        for i in sorted(chunk, key=lambda j: -lengths[j]):  # stable: ties keep the shuffled order
            r = min((r for r in range(world) if len(mine_of[r]) < per_rank), key=lambda r: (load[r], r))
            mine_of[r].append(i)
            load[r] += lengths[i]
        mine = mine_of[rank]
    else:
        mine = chunk[rank * per_rank:(rank + 1) * per_rank]
    return [mine[m * micro_batch_size:(m + 1) * micro_batch_size] for m in range(grad_accum)]
