"""MiniMax-M3 MoE routing in two Triton kernels: fp32 router GEMV, then sigmoid + biased top-k.

Maths (same as ``models.minimax_m3.layers.route``), per token row ``t``:
``s = sigmoid(fp32(x_t) W^T)``; ``ids = topk(s + bias)`` (the correction bias only selects);
``w = s[ids] / sum(s[ids]) * scale``. Rows ``>= num_real_tokens`` (padding) get id -1 and
weight 0. For expert parallelism the global ids are remapped to this rank's local ids
``id - expert_offset`` when in ``[0, num_local)``; pairs routed to another rank get local id
-1 and weight 0 here, and the global ids can be kept in ``global_ids_out``.

Kernels:
- ``_router_logits_kernel``, grid (token tile, H split, expert tile): a true fp32 dot (bf16 x
  is upcast as it is loaded; ``input_precision="ieee"``, never tf32, because bf16/tf32
  scores flip near-tied expert choices). Even one token spreads the 3 MB fp32 weight read
  over ~100-250 programs by splitting E and H; every program writes its fp32 partial logits
  to a scratch ``[splits, T, E]``. Large T is tiled as well (up to 64 tokens per program),
  so the weight is read once per token tile rather than once per token. On token tiles (more
  than two tokens) bf16 activations take three bf16 tensor-core dots against the weight split
  into three bf16 parts in registers (products exact, each step's sum promoted to fp32: closer
  to the fp64 logits than SGEMM); other dtypes the fp32 FMA dot and, from
  ``CUBLAS_MIN_TOKENS`` tokens (prefill-sized steps), one cuBLAS SGEMM.
- ``_router_topk_kernel``, grid (token): sums the partials in a fixed order (one reduction
  tree over the splits, the same on every run: deterministic), sigmoid, bias, top-k by ``K``
  rounds of max (ties go to the lower expert id), renormalisation, scale, padding and the
  local remap. For measurements it can replace the picks by the routing simulation's
  (``routing_sim``), and at decode sizes its last program can align the pairs for the fused MoE
  (``moe_align``): two launches a real step would otherwise add (H100, 30 layers: top-k,
  simulation and align 6.3 -> 5.0 us per MoE layer at decode 1, 7.4 -> 6.0 at decode 32).
  Not kept: the add + RMSNorm before the router made inside the GEMV at one or two tokens
  (each program summing its row's squares): with PDL off the norm's 2.4 us a layer went and
  the GEMV and top-k took 0.5 us longer; with PDL no shorter graph span (H100, 60 layers;
  ``benchmarks/results/decode_launches_r13/``).

Both launches are graph-safe: no host syncs, ``num_real_tokens`` is read on the device, and
the grids and the scratch size depend only on ``T`` and the weight shape.

``route_torch`` is the same computation in plain torch (the reference and the CPU path); its
ties follow ``torch.topk``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from attention.kernels.arrival import arrival_counters, arrive
from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.triton_utils import check_device, interpreting, next_pow2, num_sms
from models.minimax_m3.layers import route

from .moe_align import MoEAlignment, align_chunk, align_pairs, aligns_in_one_program
from .routing_sim import simulated_picks

if TYPE_CHECKING:
    from models.minimax_m3.routing import RoutingSimulation

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# launch configuration


@dataclass(frozen=True)
class RouterConfig:
    """Tiles of the GEMV kernel and of the top-k kernel for one (T, E, H).

    Attributes:
        block_t, block_e, block_h: GEMV tile (tokens, experts, hidden step). ``block_t == 1`` is
            the pure GEMV (multiply + row sums); ``block_t >= 16`` uses an fp32 FMA ``tl.dot``.
        h_per_split: hidden columns per split (a multiple of ``block_h``); splits: their count.
        gemv_warps, topk_warps: ``num_warps`` of the two launches.
    """

    block_t: int
    block_e: int
    block_h: int
    h_per_split: int
    splits: int
    gemv_warps: int
    topk_warps: int
    cublas: bool = False  # logits from one cuBLAS SGEMM (true fp32) instead of the Triton GEMV
    bf16_split: bool = False  # token tiles as three bf16 tensor-core dots (bf16 x; see the kernel)
    weight_a: bool = False  # bf16_split with the weight parts as the dots' first operand (see the kernel)

#: From this many tokens the GEMM is compute-bound in fp32 (1.7 GFLOP at 1054 tokens), where
#: the Triton FMA dot measured 318 us per layer on an H200 against ~50 us for cuBLAS SGEMM (tf32
#: stays off: ``torch.backends.cuda.matmul.allow_tf32``). bf16 activations then take the
#: three-part bf16 dot (``bf16_split``; H100, 1054 tokens, routing with the top-k kernel 43.8
#: us against 85.1 with SGEMM logits), others cuBLAS.
CUBLAS_MIN_TOKENS = 128
#: Whether bf16 activations at ``CUBLAS_MIN_TOKENS`` or more take the three-part bf16 dot.
BF16_SPLIT = True
#: Hidden columns a program of the three-part bf16 dot sums (see :func:`bf16_split_config`).
BF16_SPLIT_COLUMNS = 768


def router_config(T: int, E: int, H: int, sms: int, x_dtype: torch.dtype = torch.bfloat16) -> RouterConfig:
    """Pick the tiles from the shapes and the activations' dtype only (so a captured graph
    keeps its grid).

    The GEMV is memory-bound. At T <= 2 every program reads one [16, 256] weight tile (16 KB,
    all loads issued at once: the loop over H is not software-pipelined without a dot), so
    the 3 MB read costs one DRAM round trip over 8 x 24 programs. Token tiles (T > 2) use a
    pipelined dot and ~2 programs per SM. Splits stay <= 32 (<= 64 for T <= 2): the top-k
    kernel loads all of a token's partials at once, and they stay small next to the weight.

    bf16 token tiles take the three-part bf16 dot, 64 columns a step: Triton's true-fp32 dot
    runs on the CUDA cores and was compute-bound from a few tokens (H100, routing with the
    top-k kernel, cold L2: T=8 17.1 -> 12.1 us, T=32 18.3 -> 15.9, T=64 26.4 -> 13.1, T=100
    39.4 -> 15.4; BENCHMARKS.md, MXFP8 fifteenth round).
    """
    split3 = T > 2 and BF16_SPLIT and x_dtype == torch.bfloat16
    if T <= 2:
        # One token per program: re-reading the weight for a second token hits L2.
        bt, be, bh = 1, min(16, next_pow2(E)), min(256, next_pow2(H))
        want = min(64, triton.cdiv(H, bh))
    else:
        bt = min(64, max(16, next_pow2(T)))
        be = min(32 if T <= 64 else 64, max(16, next_pow2(E)))
        bh = min(64 if split3 else 32, max(16, next_pow2(H)))
        tiles = triton.cdiv(T, bt) * triton.cdiv(E, be)
        want = max(1, min(32, triton.cdiv(2 * sms, tiles), triton.cdiv(H, bh)))
    h_per = triton.cdiv(triton.cdiv(H, want), bh) * bh
    splits = triton.cdiv(H, h_per)
    partials = max(2, next_pow2(splits)) * max(2, next_pow2(E))  # one top-k program's tile
    # 8 warps for the 64 x 64 token tile: at 4 warps its fp32 FMA dot spills a few registers.
    # Top-k: <= 32 partials per thread, all loaded at once.
    if T >= CUBLAS_MIN_TOKENS and not interpreting():
        if BF16_SPLIT and x_dtype == torch.bfloat16:
            return bf16_split_config(E, H)
        return RouterConfig(block_t=bt, block_e=be, block_h=bh, h_per_split=H, splits=1, gemv_warps=4,
                            topk_warps=1, cublas=True)
    warps = 8 if bt * be >= 4096 and not split3 else 4
    return RouterConfig(block_t=bt, block_e=be, block_h=bh, h_per_split=h_per, splits=splits, gemv_warps=warps,
                        topk_warps=max(1, min(8, partials // 1024)), bf16_split=split3)


def bf16_split_config(E: int, H: int) -> RouterConfig:
    """Tiles of the three-part bf16 dot, the same at every token count (one build serves every
    prefill size, so no step compiles one after capture): 64 x 64 token x expert tiles (wgmma)
    over 64 hidden columns a step, ``BF16_SPLIT_COLUMNS`` columns a program (M3's 6144 in 8
    splits: a 1024-token chunk runs 16 x 2 x 8 = 256 programs, ~2 per SM). 64-expert tiles take
    the weight parts as the dots' register operand (``weight_a``; H200, routing at 1054 tokens:
    43.4 -> 30.3 us)."""
    bt, be, bh = 64, min(64, max(16, next_pow2(E))), 64
    h_per = triton.cdiv(min(H, BF16_SPLIT_COLUMNS), bh) * bh
    splits = triton.cdiv(H, h_per)
    partials = max(2, next_pow2(splits)) * max(2, next_pow2(E))
    return RouterConfig(block_t=bt, block_e=be, block_h=bh, h_per_split=h_per, splits=splits, gemv_warps=4,
                        topk_warps=max(1, min(8, partials // 1024)), bf16_split=True, weight_a=be == 64)


# --------------------------------------------------------------------------------------------
# plain torch


def route_torch(
    x: Tensor,
    gate_weight: Tensor,
    bias: Tensor,
    top_k: int,
    scale: float,
    num_real_tokens: Tensor | None,
    expert_offset: int,
    num_local: int,
    local_ids_out: Tensor,
    weights_out: Tensor,
    global_ids_out: Tensor | None = None,
) -> None:
    """Plain-torch twin of :func:`route_triton` (same arguments, same effects; ties follow
    ``torch.topk`` instead of "lower id wins")."""
    _check_args(x, gate_weight, bias, top_k, num_real_tokens, expert_offset, num_local, local_ids_out, weights_out,
                global_ids_out)
    ids, w = route(x, gate_weight, bias, top_k, scale, num_real_tokens)
    local = ids - expert_offset
    mine = (ids >= 0) & (local >= 0) & (local < num_local)
    local_ids_out.copy_(torch.where(mine, local, -1))
    weights_out.copy_(torch.where(mine, w, 0.0))
    if global_ids_out is not None:
        global_ids_out.copy_(ids)


# --------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _part_dot(xt, part, acc, WEIGHT_A: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc`` plus the product of the token tile ``xt [BLOCK_T, BLOCK_H]`` and one weight part
    ``[BLOCK_E, BLOCK_H]``: ``[BLOCK_E, BLOCK_T]`` with ``WEIGHT_A`` (the part as the dot's
    first operand), else ``[BLOCK_T, BLOCK_E]``; true fp32 dots under ``DOT_F32``."""
    if DOT_F32:
        if WEIGHT_A:
            out = tl.dot(part.to(tl.float32), tl.trans(xt.to(tl.float32)), acc, input_precision="ieee")
        else:
            out = tl.dot(xt.to(tl.float32), tl.trans(part.to(tl.float32)), acc, input_precision="ieee")
    elif WEIGHT_A:
        out = tl.dot(part, tl.trans(xt), acc)
    else:
        out = tl.dot(xt, tl.trans(part), acc)
    return out


# T unspecialised (no divisible-by-16 build): eager steps of any size share one build per config.
@triton.jit(do_not_specialize=["T"])
def _router_logits_kernel(
    x_ptr, stride_x, w_ptr, part_ptr, T,
    E: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    H_PER_SPLIT: tl.constexpr, BF16_SPLIT: tl.constexpr = False, DOT_F32: tl.constexpr = False, PDL: tl.constexpr = 0,
    WEIGHT_A: tl.constexpr = False,
):
    """part[split, t, e] = sum over this split's hidden columns h of fp32(x[t, h]) * W[e, h].

    ``BF16_SPLIT`` (bf16 x, token tiles): each fp32 weight tile is split in registers into
    three bf16 parts, ``w = hi + mid + lo + r`` with ``|r| <= 2^-27 |w|`` (each part rounds what
    the ones before left to 8 significant bits; the interpreter truncates: ``2^-21``). bf16 x
    is exact as a bf16 operand, so the three bf16 tensor-core dots form every product
    ``x * part`` exactly. Hopper's MMA accumulator keeps fewer bits than an fp32 add, so each
    64-column step's three dots start from zero and their sum is added to the fp32
    accumulator on the CUDA cores (one chain through the whole split measured 3.6x cuBLAS
    SGEMM's error against fp64 at 1054 tokens; promoted per step, 0.23x: 7.2e-7 against
    3.1e-6, a bf16 weight 8.3e-3). ``DOT_F32``: the
    same parts through fp32 dots (the interpreter, whose bf16 dots are not exact).

    ``WEIGHT_A`` (``BF16_SPLIT``, 64-expert tiles): the products as ``[experts, tokens]``, the
    weight parts the dots' first operand. wgmma takes its first operand from registers, where
    the parts are made; as the second they were first stored to shared memory, three tiles a
    step, each store waited for before its dot."""
    grid_dependency(PDL)
    pt = tl.program_id(0)  # token tiles first: programs sharing a weight tile run close together (L2)
    ps = tl.program_id(1)
    pe = tl.program_id(2)
    e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    hh = tl.arange(0, BLOCK_H)
    h0 = ps * H_PER_SPLIT
    if BLOCK_T == 1:
        # Decode GEMV: one row of x against a [BLOCK_E, BLOCK_H] weight tile per step, rows
        # summed in registers; the weight rows are contiguous in H, so the loads are 16 B wide.
        x_row = x_ptr + pt.to(tl.int64) * stride_x
        acc1 = tl.zeros([BLOCK_E], tl.float32)
        for k in range(0, H_PER_SPLIT, BLOCK_H):
            h = h0 + k + hh
            h_ok = h < H
            xv = tl.load(x_row + h, mask=h_ok, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + e[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            acc1 += tl.sum(wv * xv[None, :], axis=1)
        tl.store(part_ptr + (ps * T + pt) * E + e, acc1, mask=e_ok)
    else:
        # A token tile, the weight tile shared by BLOCK_T tokens: fp32 FMA dot (ieee: no tf32),
        # or the three-part bf16 dot.
        t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x
        if WEIGHT_A:
            acc = tl.zeros([BLOCK_E, BLOCK_T], tl.float32)
        else:
            acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for k in range(0, H_PER_SPLIT, BLOCK_H):
            h = h0 + k + hh
            h_ok = h < H
            xt = tl.load(x_rows + h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + e[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            if BF16_SPLIT:
                hi = wt.to(tl.bfloat16)
                rest = wt - hi.to(tl.float32)  # exact in fp32, as is the next remainder
                mid = rest.to(tl.bfloat16)
                lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
                if DOT_F32:
                    acc = _part_dot(xt, lo, acc, WEIGHT_A, True)
                    acc = _part_dot(xt, mid, acc, WEIGHT_A, True)
                    acc = _part_dot(xt, hi, acc, WEIGHT_A, True)
                else:  # smallest part first, each step's sum added to acc on the CUDA cores
                    step = _part_dot(xt, lo, None, WEIGHT_A, False)
                    step = _part_dot(xt, mid, step, WEIGHT_A, False)
                    acc += _part_dot(xt, hi, step, WEIGHT_A, False)
            else:
                acc += tl.dot(xt.to(tl.float32), tl.trans(wt), input_precision="ieee")
        if WEIGHT_A:
            tl.store(part_ptr + (ps * T + t[None, :]) * E + e[:, None], acc, mask=t_ok[None, :] & e_ok[:, None])
        else:
            tl.store(part_ptr + (ps * T + t[:, None]) * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _router_topk_kernel(
    part_ptr, bias_ptr, nrt_ptr, local_ptr, wout_ptr, glob_ptr, x_ptr, stride_x, hidden, stride_pick,
    count_ptr, off_ptr, sorted_ptr, pos_ptr,
    T, expert_offset, num_local, scale,
    E: tl.constexpr, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_NRT: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    SIMULATE: tl.constexpr = False, UNIFORM: tl.constexpr = False,
    ALIGN: tl.constexpr = False, NL: tl.constexpr = 1, NL_PAD: tl.constexpr = 2, CHUNK: tl.constexpr = 16,
    PDL: tl.constexpr = 0,
):
    """Token t: logits from the partials -> K (expert, weight) pairs, padded and remapped.

    One token per program keeps every reduction one-dimensional (a [tokens, experts] tile
    took several times the registers); a grid of T programs of a few KB each is cheap even
    at T = 1054. ``SIMULATE`` (``routing_sim``; ``UNIFORM`` or balanced): a real token's
    experts are the simulation's picks (from ``x``), its weights still the router's, slot by
    slot. ``ALIGN``: the last program to finish sorts the step's local pairs for the fused MoE
    (``moe_align.align_pairs`` over the ``NL`` local experts, one chunk of ``CHUNK`` pairs),
    instead of an align launch.
    """
    grid_dependency(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    # All partials in one [splits, experts] load, so the loads are in flight together (a loop
    # over the splits, even unrolled, is scheduled load-add-load and waits for each), then
    # one fixed reduction tree over the splits: the logits are bitwise reproducible.
    sp = tl.arange(0, SPLITS_PAD)
    parts = tl.load(part_ptr + (sp[:, None] * T + t) * E + e[None, :],
                    mask=(sp < SPLITS)[:, None] & e_ok[None, :], other=0.0)
    z = tl.sum(parts, axis=0)
    score = 1.0 / (1.0 + tl.exp(-z))
    b = tl.load(bias_ptr + e, mask=e_ok, other=0.0)
    sel = tl.where(e_ok, score + b, float("-inf"))
    kk = tl.arange(0, K_PAD)
    ids = tl.full([K_PAD], -1, tl.int32)
    ws = tl.zeros([K_PAD], tl.float32)
    for k in tl.static_range(K):
        best = tl.max(sel, axis=0)
        # lowest expert id among the maxima: deterministic ties (a NaN row finds none: E_PAD)
        idx = tl.min(tl.where(sel == best, e, E_PAD), axis=0)
        hit = e == idx
        wk = tl.sum(tl.where(hit, score, 0.0), axis=0)
        sel = tl.where(hit, float("-inf"), sel)
        ids = tl.where(kk == k, idx, ids)
        ws = tl.where(kk == k, wk, ws)
    w = ws / tl.sum(ws, axis=0) * scale
    if HAS_NRT:
        n_real = tl.load(nrt_ptr)
    else:
        n_real = T
    ok = (t < n_real) & (ids >= 0) & (ids < E)
    if SIMULATE:
        ids = simulated_picks(x_ptr, stride_x, hidden, t.to(tl.int64), E, stride_pick, K, K_PAD, E_PAD,
                              UNIFORM).to(tl.int32)
    gid = tl.where(ok, ids, -1)
    loc = gid - expert_offset
    mine = ok & (loc >= 0) & (loc < num_local)
    out = t * K + kk
    k_ok = kk < K
    tl.store(local_ptr + out, tl.where(mine, loc, -1), mask=k_ok)
    tl.store(wout_ptr + out, tl.where(mine, w, 0.0), mask=k_ok)
    if HAS_GLOBAL:
        tl.store(glob_ptr + out, gid, mask=k_ok)
    if ALIGN:
        if arrive(count_ptr, T):  # every token's local ids are stored
            align_pairs(local_ptr, local_ptr, off_ptr, sorted_ptr, pos_ptr, T, 1, 0, K, NL, NL_PAD, 2, CHUNK, True,
                        True)


def route_triton(
    x: Tensor,
    gate_weight: Tensor,
    bias: Tensor,
    top_k: int,
    scale: float,
    num_real_tokens: Tensor | None,
    expert_offset: int,
    num_local: int,
    local_ids_out: Tensor,
    weights_out: Tensor,
    global_ids_out: Tensor | None = None,
    *,
    config: RouterConfig | None = None,
    simulation: RoutingSimulation | None = None,
    align_out: MoEAlignment | None = None,
) -> None:
    """Sigmoid routing with a selection-only correction bias, written into caller buffers.

    Args:
        x: ``[T, H]`` activations (bf16; fp16/fp32 too), rows contiguous; upcast in-kernel.
        gate_weight: fp32 ``[E, H]`` router weight, contiguous. bias: fp32 ``[E]``.
        top_k: experts per token (``K <= E``). scale: routed scaling factor (2.0 for M3).
        num_real_tokens: int device tensor ``[1]`` (rows at or past it are padding), or None.
        expert_offset, num_local: this rank holds global experts ``[offset, offset + num_local)``.
        local_ids_out: int32 ``[T, K]``: local expert id, or -1 (padding / another rank's pair).
        weights_out: fp32 ``[T, K]``: routing weight, 0 where ``local_ids_out`` is -1.
        global_ids_out: optional int32 ``[T, K]``: global expert id, -1 on padded rows.
        config: tiles to use instead of :func:`router_config`'s (tests and benchmarks).
        simulation: replace the router's experts of every real token by the simulation's picks
            (``routing.RoutingSimulation``, in the top-k kernel: no launch of its own); the
            weights stay the router's, slot by slot, and ``global_ids_out`` gets the picks.
        align_out: buffers (``moe_align.alignment_buffers(T, top_k, num_local)``) for the fused
            MoE's alignment of ``local_ids_out``, made by the top-k kernel's last program (one
            launch fewer); only where one program holds every pair (``aligns_in_one_program``).

    Raises:
        ValueError: bad shapes or dtypes (named), or ``align_out`` where the pairs need more
            than one align program.
    """
    _check_args(x, gate_weight, bias, top_k, num_real_tokens, expert_offset, num_local, local_ids_out, weights_out,
                global_ids_out)
    check_device("route_triton", x, gate_weight, bias, local_ids_out, weights_out, *(align_out or ()))
    T, H = x.shape
    E = gate_weight.shape[0]
    if align_out is not None:
        _check_align_out(align_out, T, top_k, num_local)
    if T == 0:
        return
    cfg = config or router_config(T, E, H, num_sms(x.device), x.dtype)
    part = router_logit_partials(x, gate_weight, cfg)
    stride_pick = 1
    if simulation is not None:
        simulation.check_experts(E)
        stride_pick = simulation.stride(E)
    nrt = num_real_tokens if num_real_tokens is not None else local_ids_out  # any pointer: unused
    glob = global_ids_out if global_ids_out is not None else local_ids_out
    al = align_out if align_out is not None else (local_ids_out,) * 3  # unread without ALIGN
    counts = arrival_counters(x.device, 1) if align_out is not None else local_ids_out
    _router_topk_kernel[(T,)](
        part, bias, nrt, local_ids_out, weights_out, glob, x, x.stride(0), H, stride_pick, counts, *al,
        T, expert_offset, num_local, float(scale),
        E=E, K=top_k, E_PAD=max(2, next_pow2(E)), K_PAD=max(2, next_pow2(top_k)),
        SPLITS=cfg.splits, SPLITS_PAD=max(2, next_pow2(cfg.splits)), HAS_NRT=num_real_tokens is not None,
        HAS_GLOBAL=global_ids_out is not None, SIMULATE=simulation is not None,
        UNIFORM=simulation is not None and simulation.strategy == "uniform", ALIGN=align_out is not None,
        NL=max(1, num_local), NL_PAD=max(2, next_pow2(num_local)), CHUNK=align_chunk(T * top_k, num_local),
        num_warps=cfg.topk_warps, **pdl_launch(x.device),
    )


def router_logit_partials(x: Tensor, gate_weight: Tensor, cfg: RouterConfig) -> Tensor:
    """The logits in ``cfg.splits`` fp32 partial sums: ``[splits, T, E]``, summing (in a fixed
    order) to ``fp32(x) W^T``. x ``[T, H]`` (contiguous rows), gate_weight fp32 ``[E, H]``.

    Raises:
        ValueError: ``cfg`` does not tile H, or ``bf16_split`` with activations not bf16.
        RuntimeError: the cuBLAS path with tf32 matmuls allowed.
    """
    T, H = x.shape
    E = gate_weight.shape[0]
    _check_config(cfg, H)
    if cfg.bf16_split and x.dtype != torch.bfloat16:
        raise ValueError(f"router config {cfg} splits the weight into bf16 parts, which is exact only for bf16 "
                         f"activations; got {x.dtype} (use router_config(..., x_dtype))")
    if cfg.cublas:  # one fp32 GEMM (plus the upcast of x): the logits are the single "partial"
        if torch.backends.cuda.matmul.allow_tf32:
            raise RuntimeError("route_triton's cuBLAS path needs true fp32: torch.backends.cuda.matmul.allow_tf32 is "
                               "on, which would round the router logits to tf32 and flip near-tied experts")
        return torch.nn.functional.linear(x.float(), gate_weight).unsqueeze(0)
    part = torch.empty((cfg.splits, T, E), dtype=torch.float32, device=x.device)
    grid1 = (triton.cdiv(T, cfg.block_t), cfg.splits, triton.cdiv(E, cfg.block_e))
    _router_logits_kernel[grid1](
        x, x.stride(0), gate_weight, part, T,
        E=E, H=H, BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_H=cfg.block_h, H_PER_SPLIT=cfg.h_per_split,
        BF16_SPLIT=cfg.bf16_split, WEIGHT_A=cfg.weight_a, DOT_F32=interpreting(), num_warps=cfg.gemv_warps,
        num_stages=3,
        **pdl_launch(x.device),
    )
    return part


def _check_align_out(align_out: MoEAlignment, T: int, top_k: int, num_local: int) -> None:
    if not aligns_in_one_program(T, top_k, num_local):
        raise ValueError(f"align_out: {T} tokens x top-{top_k} over {num_local} local experts need more than one align "
                         "program; leave align_out None and let fused_moe align (moe_align)")
    want = (num_local + 2, T * top_k + T, T * top_k + T)
    for name, t, n in zip(MoEAlignment._fields, align_out, want):
        if t.shape != (n,) or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"align_out.{name} must be a contiguous int32 [{n}] tensor, got {t.dtype} "
                             f"{tuple(t.shape)} (moe_align.alignment_buffers makes them)")


def _check_config(cfg: RouterConfig, H: int) -> None:
    tiles = (cfg.block_t, cfg.block_e, cfg.block_h)
    pow2 = all(v >= 1 and v & (v - 1) == 0 for v in tiles)
    dot_ok = cfg.block_t == 1 or min(cfg.block_t, cfg.block_e, cfg.block_h) >= 16  # tl.dot needs >= 16
    if not (pow2 and dot_ok and cfg.h_per_split % cfg.block_h == 0 and cfg.splits * cfg.h_per_split >= H
            and (cfg.splits - 1) * cfg.h_per_split < H):
        raise ValueError(f"router config {cfg} does not tile H={H}: tiles must be powers of two, block_t 1 or a dot "
                         f"tile (all three >= 16), h_per_split a multiple of block_h, splits = cdiv(H, h_per_split)")


def _check_args(x: Tensor, gate_weight: Tensor, bias: Tensor, top_k: int, num_real_tokens: Tensor | None,
                expert_offset: int, num_local: int, local_ids_out: Tensor, weights_out: Tensor,
                global_ids_out: Tensor | None) -> None:
    if x.dim() != 2 or not x.is_floating_point() or x.stride(1) != 1:
        raise ValueError(f"x must be a float [T, H] tensor with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    T, H = x.shape
    if gate_weight.dim() != 2 or gate_weight.shape[1] != H or gate_weight.dtype != torch.float32 \
            or not gate_weight.is_contiguous():
        raise ValueError(f"gate_weight must be a contiguous fp32 [E, {H}] tensor, got {gate_weight.dtype} "
                         f"{tuple(gate_weight.shape)}")
    E = gate_weight.shape[0]
    if bias.shape != (E,) or bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous fp32 [{E}] tensor, got {bias.dtype} {tuple(bias.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}] (the number of experts), got {top_k}")
    if num_real_tokens is not None and (num_real_tokens.numel() != 1 or num_real_tokens.is_floating_point()):
        raise ValueError(f"num_real_tokens must be an integer tensor of one element, got {num_real_tokens.dtype} "
                         f"{tuple(num_real_tokens.shape)}")
    if expert_offset < 0 or num_local < 0 or expert_offset + num_local > E:
        raise ValueError(f"local experts [expert_offset, expert_offset + num_local) = [{expert_offset}, "
                         f"{expert_offset + num_local}) must lie inside [0, {E})")
    outs = (("local_ids_out", local_ids_out, torch.int32), ("weights_out", weights_out, torch.float32),
            ("global_ids_out", global_ids_out, torch.int32))
    for name, t, dtype in outs:
        if t is not None and (t.shape != (T, top_k) or t.dtype != dtype or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {dtype} [{T}, {top_k}] tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")


__all__ = ["RouterConfig", "route_torch", "route_triton", "router_config"]
