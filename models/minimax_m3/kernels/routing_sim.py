"""The routing simulation of ``models.minimax_m3.routing.RoutingSimulation`` on the device, as a
Triton function the router's top-k kernel calls (``kernels.router``): the simulated picks of a
token, which replace the router's ids where the token is real.

The torch version is about 30 small kernels (integer hash, top-k, masks), ~30 us per layer at
decode, which would be measured as MoE time that a real model does not spend. A kernel of its
own after the router's top-k cost 1.8-1.9 us per MoE layer at every step size (H100, 30
layers, decode 1 and 32), a launch a real deployment does not have either; inside the top-k
kernel the simulation adds a 64-column load and a few integer rounds to a program that is
already there. The picks are the torch simulation's: the same integer hash of the same
hidden-state bits, the same experts in the same order (the hash values of a row are distinct:
the expert id rides in the low 8 bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from models.minimax_m3.routing import KEY_COLUMNS

_KEY_COLUMNS = tl.constexpr(KEY_COLUMNS)  # the torch simulation's: the same key


@triton.jit
def simulated_picks(x_ptr, stride_x, hidden, t, num_experts, stride_pick, K: tl.constexpr, K_PAD: tl.constexpr,
                    E_PAD: tl.constexpr, UNIFORM: tl.constexpr):
    """int64 ``[K_PAD]``: the global experts token ``t`` (int64) picks. ``UNIFORM``: by a hash
    of its hidden state's first columns, largest hash first as ``torch.topk`` sorts; else the
    balanced walk's ``(t * K + k) * stride_pick % num_experts``. Entries from ``K`` on are
    unspecified."""
    ks = tl.arange(0, K_PAD)
    m32 = 0xFFFFFFFF
    if UNIFORM:
        c = tl.arange(0, _KEY_COLUMNS)
        xv = tl.load(x_ptr + t * stride_x + c, mask=c < hidden, other=0.0).to(tl.float32)
        bits = xv.to(tl.int32, bitcast=True).to(tl.int64) & m32
        mult = c.to(tl.int64) * 2_654_435 + 40_503
        key = tl.sum(tl.where(c < hidden, (bits * mult) & m32, 0), axis=0) & 0x7FFFFFFF
        e = tl.arange(0, E_PAD).to(tl.int64)
        h = (key * 0x2F3A1B + e * 0x45D9F3B + 0x3C6EF372) & m32
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & m32
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & m32
        h = ((h ^ (h >> 16)) << 8) | e
        h = tl.where(e < num_experts, h, -1)
        picks = tl.zeros([K_PAD], dtype=tl.int64)
        for j in tl.static_range(K):  # top-k, largest first (as torch.topk sorts)
            top = tl.max(h, axis=0)
            picks = tl.where(ks == j, top & 255, picks)
            h = tl.where(h == top, -1, h)
    else:
        picks = ((t * K + ks) * stride_pick) % num_experts
    return picks


__all__ = ["simulated_picks"]
