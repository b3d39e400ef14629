"""Which part of a full tensor dimension one rank holds: the two rules every sharded layer
uses (a model maps its parameters to them: MiniMax-M3 in ``weights.checkpoint_layout``).

- ``split_slice``: an even split (column-parallel outputs, row-parallel inputs, vocab rows,
  experts).
- ``head_slice``: attention heads, split while there are at least as many heads as ranks and
  replicated above that (``world / heads`` ranks then hold the same head), so GQA groups stay
  whole: rank r's query heads always use the kv heads it holds.
"""

from __future__ import annotations


def split_slice(size: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous ``size / world`` part of ``range(size)``.

    Raises:
        ValueError: ``size`` not divisible by ``world``, or ``rank`` outside ``[0, world)``.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank} must lie in [0, world={world})")
    if size % world:
        raise ValueError(f"a dimension of {size} cannot be split evenly over {world} ranks")
    n = size // world
    return slice(rank * n, (rank + 1) * n)


def head_slice(num_heads: int, head_dim: int, rank: int, world: int) -> slice:
    """The rows (``head_dim`` each) of the heads rank ``rank`` holds: ``num_heads / world``
    heads when ``world <= num_heads``, else the one head ``rank // (world / num_heads)``.

    Raises:
        ValueError: heads neither divisible by ``world`` nor dividing it.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank} must lie in [0, world={world})")
    if world <= num_heads:
        if num_heads % world:
            raise ValueError(f"{num_heads} heads cannot be split evenly over {world} ranks")
        per = num_heads // world
        first = rank * per
    else:
        if world % num_heads:
            raise ValueError(f"{num_heads} heads cannot be replicated evenly over {world} ranks")
        per, first = 1, rank // (world // num_heads)
    return slice(first * head_dim, (first + per) * head_dim)
