"""Brute-force MiniMax-M3 forward, written from the spec (MINIMAX_M3.md §2-§3) alone.

Independent of ``models/minimax_m3``: it reads checkpoint-format tensors (separate q/k/v/index
projections, per-expert w1/w2/w3), uses no pages and no cache, builds token-level masks, and
loops over tokens for block selection and routing. Everything in fp64. One sequence at a
time, positions ``0 .. L-1``.
"""

from __future__ import annotations

import math

import torch


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim."""
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(ms + eps) * (1 + w)


def rope(x: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX split-half rotation of dims ``[0, rotary_dim)`` of ``x [L, heads, d]`` at
    positions ``0 .. L-1``, one pair ``(i, i + rotary_dim/2)`` at a time."""
    out = x.clone()
    half = rotary_dim // 2
    pos = torch.arange(x.shape[0], dtype=torch.float64)
    for i in range(half):
        ang = pos * theta ** (-2.0 * i / rotary_dim)
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        a, b = x[:, :, i], x[:, :, i + half]
        out[:, :, i] = a * c - b * s
        out[:, :, i + half] = b * c + a * s
    return out


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g = torch.minimum(g, torch.tensor(limit, dtype=g.dtype))
    u = torch.maximum(torch.minimum(u, torch.tensor(limit, dtype=u.dtype)), torch.tensor(-limit, dtype=u.dtype))
    return g * (1 / (1 + torch.exp(-alpha * g))) * (u + 1)


def selected_blocks(iq: torch.Tensor, ik: torch.Tensor, p: int, block: int, topk: int) -> list[int]:
    """Blocks one (group, query at position p) attends: all visible blocks if there are at
    most ``topk``, else the local block plus the ``topk - 1`` best others by causal max score."""
    nb = p // block + 1
    if nb <= topk:
        return list(range(nb))
    local = p // block
    scores = []
    for b in range(nb - 1):  # every block before the local one is fully visible
        keys = range(b * block, (b + 1) * block)
        scores.append((max(float(iq @ ik[j]) for j in keys), b))
    best = sorted(scores, key=lambda sb: (-sb[0], sb[1]))[: topk - 1]
    return [b for _, b in best] + [local]


def attention(c, w: dict, pre: str, a: torch.Tensor, sparse: bool) -> torch.Tensor:
    L = a.shape[0]
    nq, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = (a @ w[pre + "q_proj.weight"].T).view(L, nq, d)
    k = (a @ w[pre + "k_proj.weight"].T).view(L, nkv, d)
    v = (a @ w[pre + "v_proj.weight"].T).view(L, nkv, d)
    q = rope(gemma_norm(q, w[pre + "q_norm.weight"], c.rms_norm_eps), c.rotary_dim, c.rope_theta)
    k = rope(gemma_norm(k, w[pre + "k_norm.weight"], c.rms_norm_eps), c.rotary_dim, c.rope_theta)
    allowed = torch.zeros(nkv, L, L, dtype=torch.bool)
    for p in range(L):
        allowed[:, p, : p + 1] = True
    has_index = pre + "index_q_proj.weight" in w
    if has_index:
        di = c.sparse_index_dim
        iq = (a @ w[pre + "index_q_proj.weight"].T).view(L, nkv, di)
        ik = (a @ w[pre + "index_k_proj.weight"].T).view(L, 1, di)
        iq = rope(gemma_norm(iq, w[pre + "index_q_norm.weight"], c.rms_norm_eps), c.rotary_dim, c.rope_theta)
        ik = rope(gemma_norm(ik, w[pre + "index_k_norm.weight"], c.rms_norm_eps), c.rotary_dim, c.rope_theta)[:, 0]
        if sparse:
            allowed.zero_()
            for g in range(nkv):
                for p in range(L):
                    for b in selected_blocks(iq[p, g], ik, p, c.sparse_block_size, c.sparse_topk_blocks):
                        for j in range(b * c.sparse_block_size, min((b + 1) * c.sparse_block_size, p + 1)):
                            allowed[g, p, j] = True
    out = torch.zeros(L, nq, d, dtype=a.dtype)
    grp = nq // nkv
    for h in range(nq):
        g = h // grp
        s = (q[:, h] @ k[:, g].T) / math.sqrt(d)
        s = s.masked_fill(~allowed[g], float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ v[:, g]
    return out.reshape(L, nq * d) @ w[pre + "o_proj.weight"].T


def mlp(c, w: dict, pre: str, x: torch.Tensor) -> torch.Tensor:
    g = x @ w[pre + "gate_proj.weight"].T
    u = x @ w[pre + "up_proj.weight"].T
    return swiglu_oai(g, u, c.swiglu_alpha, c.swiglu_limit) @ w[pre + "down_proj.weight"].T


def moe(c, w: dict, pre: str, x: torch.Tensor) -> torch.Tensor:
    out = mlp(c, w, pre + "shared_experts.", x)
    gate = w[pre + "gate.weight"]
    bias = w[pre + "e_score_correction_bias"]
    for t in range(x.shape[0]):
        s = 1 / (1 + torch.exp(-(gate @ x[t])))
        choice = s + bias
        ids = sorted(range(c.num_local_experts), key=lambda e: -float(choice[e]))[: c.num_experts_per_tok]
        total = sum(float(s[e]) for e in ids)
        for e in ids:
            ex = f"{pre}experts.{e}."
            h = swiglu_oai(w[ex + "w1.weight"] @ x[t], w[ex + "w3.weight"] @ x[t], c.swiglu_alpha, c.swiglu_limit)
            out[t] += float(s[e]) / total * c.routed_scaling_factor * (w[ex + "w2.weight"] @ h)
    return out


def reference_logits(c, weights: dict[str, torch.Tensor], input_ids: list[int], sparse: bool = True) -> torch.Tensor:
    """Logits ``[L, vocab]`` (fp64) of one sequence at positions ``0..L-1``.

    Args:
        c: a ``MiniMaxM3Config`` (only its numbers are read).
        weights: text tensors under their checkpoint names without ``language_model.``.
        sparse: False runs the sparse layers with dense causal attention (to show that the
            sparse selection changes the result).
    """
    w = {k: v.double() for k, v in weights.items()}
    x = w["model.embed_tokens.weight"][torch.tensor(input_ids)]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        a = gemma_norm(x, w[pre + "input_layernorm.weight"], c.rms_norm_eps)
        x = x + attention(c, w, pre + "self_attn.", a, sparse)
        b = gemma_norm(x, w[pre + "post_attention_layernorm.weight"], c.rms_norm_eps)
        x = x + (moe(c, w, pre + "block_sparse_moe.", b) if pre + "block_sparse_moe.gate.weight" in w
                 else mlp(c, w, pre + "mlp.", b))
    h = gemma_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    return h @ w["lm_head.weight"].T
