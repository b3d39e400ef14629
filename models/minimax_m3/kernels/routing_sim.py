"""The routing simulation of ``models.minimax_m3.routing.RoutingSimulation`` as one kernel per
MoE layer, for the fused MoE: the router's global ids in, this rank's local ids and weights out.

The torch version is about 30 small kernels (integer hash, top-k, masks), ~30 us per layer at
decode, which would be measured as MoE time that a real model does not spend. One program per
token computes the same integer hash of the same hidden-state bits and picks the same experts
in the same order (the hash values of a row are distinct: the expert id rides in the low 8
bits), then keeps the pairs this rank holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.triton_utils import check_device

Tensor = torch.Tensor


@triton.jit
def _simulated_routing_kernel(x_ptr, stride_x, hidden, gid_ptr, w_ptr, lid_ptr, wout_ptr, offset, num_local,
                              num_experts, stride_pick, K: tl.constexpr, K_PAD: tl.constexpr,
                              E_PAD: tl.constexpr, COLS: tl.constexpr, UNIFORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_PAD)
    kmask = ks < K
    real = tl.load(gid_ptr + t * K + ks, mask=kmask, other=-1) >= 0  # padded rows: -1 everywhere
    m32 = 0xFFFFFFFF
    if UNIFORM:
        c = tl.arange(0, COLS)
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
    local = picks - offset
    held = real & (local >= 0) & (local < num_local)
    w = tl.load(w_ptr + t * K + ks, mask=kmask, other=0.0)
    tl.store(lid_ptr + t * K + ks, tl.where(held, local, -1).to(tl.int32), mask=kmask)
    tl.store(wout_ptr + t * K + ks, tl.where(held, w, 0.0), mask=kmask)


def simulated_routing_triton(x: Tensor, global_ids: Tensor, weights: Tensor, uniform: bool, stride_pick: int,
                             num_experts: int, expert_offset: int, num_local: int, local_ids_out: Tensor,
                             weights_out: Tensor) -> None:
    """Replace the router's picks (capturable, no host sync).

    Args:
        x: ``[T, H]`` the MoE input (the token key is hashed from its first 64 columns).
        global_ids: int32 ``[T, K]`` the router's global ids (-1 on padded rows);
            weights: fp32 ``[T, K]`` its weights, unmasked (every pick's, local or not).
        uniform: the ``uniform`` strategy (else ``balanced``, walking the experts by
            ``stride_pick``).
        num_experts: experts in all (<= 256); this rank holds ``[expert_offset, + num_local)``.
        local_ids_out: int32 ``[T, K]``: local id of each simulated pick, or -1 (padding,
            another rank's expert); weights_out: fp32 ``[T, K]``, 0 where the id is -1.
    """
    check_device("simulated_routing", x, global_ids, weights, local_ids_out, weights_out)
    t, k = global_ids.shape
    if x.stride(1) != 1 or not all(a.is_contiguous() for a in (global_ids, weights, local_ids_out, weights_out)):
        raise ValueError("simulated_routing: x rows and the id / weight buffers must be contiguous")
    if t == 0:
        return
    _simulated_routing_kernel[(t,)](
        x, x.stride(0), x.shape[1], global_ids, weights, local_ids_out, weights_out, expert_offset, num_local,
        num_experts, stride_pick, K=k, K_PAD=triton.next_power_of_2(k),
        E_PAD=triton.next_power_of_2(num_experts), COLS=64, UNIFORM=uniform)
