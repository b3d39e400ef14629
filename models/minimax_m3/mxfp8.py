"""The MXFP8 weight format of ``MiniMax-M3-MXFP8``: fp8 e4m3 values with one E8M0 scale per
``[1, 32]`` block along the input dim (spec §1 ``quantization_config``, §5 "Quantized variants").

A quantized linear ``[out, in]`` is stored as ``weight`` (fp8 e4m3, ``[out, in]``) and
``weight_scale_inv`` (uint8, ``[out, in / 32]``); element ``(r, c)`` is
``float(weight[r, c]) * 2 ** (weight_scale_inv[r, c // 32] - 127)``. Routed experts stack the
same layout per expert (``w13 [E, 2I, H]`` + ``w13_scale_inv [E, 2I, H / 32]``).

Here: the ``quantization_config`` parser (``MXFP8Config``), ``quantize_mxfp8`` /
``dequantize_mxfp8``, the linear module a quantized model holds (``MXFP8Linear``: dequantises
to the activation dtype and runs ``F.linear``, the plain-torch path until fp8 GEMM kernels
replace it) and the shape rule the config enforces (``check_block_alignment``). This module
imports nothing of the model (the config imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from common.values import is_int

BLOCK = 32  # input columns per E8M0 scale
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value (0.875 * 2**9)
E8M0_BIAS = 127  # scale byte b means 2**(b - 127); 255 is E8M0's NaN and is never written
SCALE_SUFFIX = "_scale_inv"  # parameter / checkpoint key of a weight's scales: name + this
QUANT_METHOD = "mxfp8"
# What the release keeps unquantized (spec §1): relative names cover every layer's module.
DEFAULT_IGNORED = ("lm_head", "model.embed_tokens", "block_sparse_moe.gate", "vision_tower",
                   "multi_modal_projector", "patch_merge_mlp")
_VISION = ("vision_tower", "multi_modal_projector", "patch_merge_mlp")
# Last name components of modules this model never quantizes: listing them changes nothing.
_NEVER_QUANTIZED = ("lm_head", "embed_tokens", "gate", "e_score_correction_bias")


# ---- quantization_config ---------------------------------------------------------------------

@dataclass(frozen=True)
class MXFP8Config:
    """An MXFP8 checkpoint's ``quantization_config``.

    Attributes:
        weight_block_size: ``(1, 32)``: one scale per row and 32 input columns (the only one).
        activation_scheme: ``dynamic`` (the only one): no activation scales in the checkpoint.
            The torch path here keeps activations in the model dtype and dequantises weights.
        ignored_layers: modules the checkpoint keeps unquantized, as the checkpoint lists them
            (``lm_head``, ``model.layers.3.block_sparse_moe.gate``...). The model's quantized
            set is fixed (every attention, MLP and expert projection); an entry naming one of
            those is refused at load time (see ``covering_entry``).
    """

    weight_block_size: tuple[int, int] = (1, BLOCK)
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = DEFAULT_IGNORED

    def __post_init__(self) -> None:
        if tuple(self.weight_block_size) != (1, BLOCK):
            raise ValueError(
                f"quantization_config.weight_block_size={list(self.weight_block_size)} is unsupported; MXFP8 "
                f"scales each [1, {BLOCK}] block (one E8M0 byte per row and {BLOCK} input columns): write [1, {BLOCK}]"
            )
        if self.activation_scheme != "dynamic":
            raise ValueError(
                f"quantization_config.activation_scheme={self.activation_scheme!r} is unsupported; only 'dynamic' "
                f"(no activation scales stored) is: write \"dynamic\" or use the bf16 checkpoint"
            )
        if not isinstance(self.ignored_layers, tuple) or not all(isinstance(e, str) for e in self.ignored_layers):
            raise ValueError(f"MXFP8Config.ignored_layers must be a tuple of module names, got {self.ignored_layers!r}")

    @classmethod
    def from_hf(cls, raw: Any) -> "MXFP8Config":
        """Parse a ``config.json`` ``quantization_config`` dict.

        Absent (or null) ``weight_block_size`` / ``activation_scheme`` mean MXFP8's own
        ``[1, 32]`` / ``dynamic``; other keys are informational and ignored.

        Raises:
            ValueError: not a dict, another ``quant_method``, another block size or activation
                scheme, or a malformed field (each named, with what to write instead).
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"quantization_config must be a JSON object, got {raw!r} ({type(raw).__name__})")
        method = raw.get("quant_method")
        if method != QUANT_METHOD:
            raise ValueError(
                f"quantization_config.quant_method={method!r} is unsupported; this loader reads only "
                f"'{QUANT_METHOD}' checkpoints (fp8 e4m3 weights, E8M0 scales per [1, {BLOCK}] block, as "
                f"MiniMax-M3-MXFP8) and unquantized ones (no quantization_config)"
            )
        block = raw.get("weight_block_size")
        if block is None:
            block = [1, BLOCK]
        if not isinstance(block, (list, tuple)) or len(block) != 2 or \
                not all(is_int(b) for b in block):
            raise ValueError(f"quantization_config.weight_block_size must be a list of two integers, got {block!r}; "
                             f"write [1, {BLOCK}]")
        scheme = raw.get("activation_scheme")
        if scheme is None:
            scheme = "dynamic"
        if not isinstance(scheme, str):
            raise ValueError(f"quantization_config.activation_scheme must be a string, got {scheme!r}; "
                             f"write \"dynamic\"")
        ignored = raw.get("ignored_layers")
        if ignored is None:
            ignored = []
        if not isinstance(ignored, (list, tuple)) or not all(isinstance(e, str) for e in ignored):
            raise ValueError(f"quantization_config.ignored_layers must be a list of module names (strings), "
                             f"got {ignored!r}")
        return cls((block[0], block[1]), scheme, tuple(ignored))

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` dict ``from_hf`` reads back to this config."""
        return {"quant_method": QUANT_METHOD, "activation_scheme": self.activation_scheme,
                "weight_block_size": list(self.weight_block_size), "ignored_layers": list(self.ignored_layers)}

    @cached_property
    def _suspect_entries(self) -> tuple[str, ...]:
        """Entries that might name a module the model quantizes (none in the release's list, so
        ``covering_entry`` costs nothing per key there)."""
        out = []
        for e in self.ignored_layers:
            name = e.removeprefix("language_model.")
            last = name.rsplit(".", 1)[-1]
            harmless = (name.split(".", 1)[0] in _VISION or name.startswith("model.mtp.")
                        or last in _NEVER_QUANTIZED or "norm" in last)
            if not harmless:
                out.append(name)
        return tuple(out)

    def covering_entry(self, module: str) -> str | None:
        """The ``ignored_layers`` entry that names ``module`` (a text-model name without
        ``language_model.``, e.g. ``model.layers.3.self_attn.o_proj``): the module itself, a
        parent (``model.layers.3``) or a relative name (``o_proj``, ``self_attn.o_proj``); None
        when no entry does."""
        for e in self._suspect_entries:
            if module == e or module.startswith(e + ".") or module.endswith("." + e):
                return e
        return None


def as_quantization(q: str | MXFP8Config | None) -> MXFP8Config | None:
    """``"mxfp8"`` -> the release's ``MXFP8Config``; a config or None passes through."""
    if q is None or isinstance(q, MXFP8Config):
        return q
    if q == QUANT_METHOD:
        return MXFP8Config()
    raise ValueError(f"quantization={q!r}: choose '{QUANT_METHOD}', an MXFP8Config, or None (unquantized)")


class _Widths(Protocol):
    """What ``check_block_alignment`` reads of a ``MiniMaxM3Config`` (not imported: it imports this)."""

    hidden_size: int
    dense_intermediate_size: int
    intermediate_size: int
    moe_layer_freq: tuple[int, ...]
    tp_size: int

    @property
    def q_size(self) -> int: ...

    @property
    def shared_width(self) -> int: ...


def check_block_alignment(c: _Widths) -> None:
    """Raise unless every quantized linear's input width is whole 32-column blocks on this rank.

    The input widths of o_proj and the down projections are column slices under tensor
    parallelism; a slice that cut a block would need half a scale byte.

    Raises:
        ValueError: naming the width, the linear it feeds and what to change.
    """
    widths = [("hidden_size", c.hidden_size, "the input of qkv_proj, gate_up_proj and the experts' w1/w3", False),
              ("num_attention_heads * head_dim", c.q_size, "o_proj's input", True)]
    if not all(c.moe_layer_freq):
        widths.append(("dense_intermediate_size", c.dense_intermediate_size, "the dense MLP's down_proj input", True))
    if any(c.moe_layer_freq):
        widths += [("intermediate_size", c.intermediate_size, "the experts' w2 input", False),
                   ("shared_intermediate_size * n_shared_experts", c.shared_width,
                    "the shared expert's down_proj input", True)]
    for name, width, what, column_slice in widths:
        if width % BLOCK == 0:
            continue
        if column_slice and c.tp_size > 1:
            raise ValueError(
                f"MXFP8 scales blocks of {BLOCK} input columns, but at tp_size={c.tp_size} each rank holds "
                f"{name}={width} columns of {what} (a slice of {width * c.tp_size}), not a multiple of {BLOCK}; "
                f"choose a tensor-parallel degree whose slices are whole blocks"
            )
        raise ValueError(
            f"MXFP8 scales blocks of {BLOCK} input columns, but {name}={width} ({what}) is not a multiple of "
            f"{BLOCK}; choose widths that are (MiniMaxM3Config.tiny(quantization='mxfp8') is a tiny model with them)"
        )


# ---- the maths -------------------------------------------------------------------------------

def _exp2(k: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** k`` for int ``k`` in ``[-127, 127]``, built from the exponent bits: exact by
    construction, where a transcendental ``exp2`` need not be. ``k = -127`` is the subnormal
    ``2 ** -127`` (bit 22 alone)."""
    biased = (k.to(torch.int32) + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS)
    bits = torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22))
    return bits.view(torch.float32)


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` to MXFP8 along its last dim (for writers and ``init_random_``, not graphs:
    it checks finiteness on the host).

    Each 32-element block gets the smallest power-of-two scale ``2**e`` with
    ``amax / 2**e <= 448`` (``e = ceil(log2(amax / 448))``, read exactly off ``frexp``: with
    ``amax = m * 2**k``, ``m`` in [0.5, 1), and ``448 = 0.875 * 2**9``, ``e = k - 9 + (m > 0.875)``),
    clamped to E8M0's ``[-127, 127]``; the values ``w / 2**e`` are rounded to e4m3 (nearest,
    ties to even). An all-zero block gets ``e = 0`` (byte 127): any scale decodes zeros to zero,
    and ``frexp(0)`` would otherwise give ``e = -9`` for no reason (a later kernel should not
    meet needless tiny scales); byte 255 (E8M0's NaN) never appears.

    Args:
        w: float ``[..., N]``, N a multiple of 32, finite.
    Returns:
        ``(q, scale_inv)``: fp8 e4m3 ``[..., N]`` and uint8 ``[..., N / 32]`` (byte = e + 127).
    Raises:
        ValueError: N not a multiple of 32, or non-finite values.
    """
    n = w.shape[-1]
    if w.dim() < 1 or n % BLOCK:
        raise ValueError(f"quantize_mxfp8 needs a last dim that is a multiple of {BLOCK}, got shape {tuple(w.shape)}")
    blocks = w.float().unflatten(-1, (n // BLOCK, BLOCK))
    if not torch.isfinite(blocks).all():
        raise ValueError(f"quantize_mxfp8 got {int((~torch.isfinite(blocks)).sum())} non-finite values")
    amax = blocks.abs().amax(-1)
    mant, exp = torch.frexp(amax)
    e = exp - 9 + (mant > FP8_MAX / 512).to(exp.dtype)
    e = torch.where(amax == 0, torch.zeros_like(e), e).clamp(-E8M0_BIAS, E8M0_BIAS)
    q = (blocks * _exp2(-e).unsqueeze(-1)).to(FP8)  # power-of-two scaling: exact before the rounding
    return q.flatten(-2), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float(q) * 2 ** (scale_inv - 127)`` per 32-column block, in ``dtype`` (exact in fp32).

    Graph-safe: fixed shapes, no host sync.

    Args:
        q: fp8 e4m3 ``[..., N]``; scale_inv: uint8 ``[..., N / 32]``.
    Returns:
        ``[..., N]`` in ``dtype``.
    """
    nb = scale_inv.shape[-1]
    w = q.to(torch.float32).unflatten(-1, (nb, BLOCK)) * _exp2(scale_inv.to(torch.int32) - E8M0_BIAS).unsqueeze(-1)
    return w.flatten(-2).to(dtype)


def invalid_count(t: torch.Tensor, is_scale: bool) -> int:
    """Non-finite elements of a loaded tensor: NaN/inf of a float tensor, fp8 e4m3's NaN codes
    (``0x7f``/``0xff``; e4m3 has no inf), or E8M0 NaN bytes (255) of a scale tensor."""
    if is_scale:
        return int((t == 255).sum())
    if t.dtype == FP8:
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if t.is_floating_point():
        return int((~torch.isfinite(t)).sum())
    return 0


# ---- modules ---------------------------------------------------------------------------------

def scale_parameter(shape: tuple[int, ...], device: torch.device | str | None) -> nn.Parameter:
    """An uninitialised uint8 scale parameter (integer parameters cannot require grad)."""
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device), requires_grad=False)


class MXFP8Linear(nn.Module):
    """A bias-free linear holding MXFP8 weights: ``weight`` fp8 e4m3 ``[out, in]`` and
    ``weight_scale_inv`` uint8 ``[out, in / 32]``.

    ``forward`` dequantises to the activation dtype and runs ``F.linear`` (fixed shapes, no host
    sync: capturable): the torch op table's path and the reference. It materialises the weight
    per call; the fused op table runs the fp8 kernels instead (``ops.FusedLinear``).
    """

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"MXFP8Linear in_features={in_features} is not a multiple of {BLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = scale_parameter((out_features, in_features // BLOCK), device)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``[out, in]`` in ``dtype``."""
        return dequantize_mxfp8(self.weight, self.weight_scale_inv, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, in]`` -> ``[T, out]`` in x's dtype."""
        return F.linear(x, self.dequantized_weight(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp8 [1, {BLOCK}]"


def make_linear(in_features: int, out_features: int, quantization: MXFP8Config | None, dtype: torch.dtype,
                device: torch.device | str | None) -> nn.Module:
    """A bias-free ``nn.Linear`` in ``dtype``, or an ``MXFP8Linear`` for a quantized model."""
    if quantization is None:
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    return MXFP8Linear(in_features, out_features, device)
