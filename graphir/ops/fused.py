"""Fused ops: one table entry each, registered into graphir.ops.OPS, produced only by passes.

Each reference is written as the composition of the unfused ops' references, so a fused op
means exactly what the pattern it replaces means; tests compare the two on random data.
"""

from __future__ import annotations

import numpy as np

from graphir.ops.core import (
    OPS,
    REQUIRED,
    Type,
    _binary_infer,
    _norm_ref,
    _rope_infer,
    _set_rows_infer,
    need,
    numel,
    op,
)

_rms_norm = _norm_ref("rms")
_rope_params = {"n_dims": (int, REQUIRED), "mode": (str, "norm"), "theta": (float, 10000.0),
                "freq_scale": (float, 1.0)}


def _add_rms_norm_mul_infer(ts: list[Type], p: dict) -> list[Type]:
    a, b, w = ts
    s = _binary_infer([a, b], p)  # the residual sum a + b
    _binary_infer([s, w], p)  # the norm weight broadcasts onto it
    return [s, s]


def _add_rms_norm_mul_ref(a: np.ndarray, b: np.ndarray, w: np.ndarray, eps: float):
    s = OPS["add"].ref(a, b)
    return OPS["mul"].ref(_rms_norm(s, eps), w), s


op("add_rms_norm_mul", 3,
   "s = a + b; returns (rms_norm(s, eps) * w, s): the normalized input of the next block and the residual",
   {"eps": (float, REQUIRED)}, multi=True)((_add_rms_norm_mul_infer, _add_rms_norm_mul_ref))


def _rms_norm_mul_rope_infer(ts: list[Type], p: dict) -> Type:
    x, w, pos = ts
    _binary_infer([x, w], p)
    return _rope_infer([x, pos], p)


def _rms_norm_mul_rope_ref(x, w, pos, eps: float, **rope) -> np.ndarray:
    return OPS["rope"].ref(OPS["mul"].ref(_rms_norm(x, eps), w), pos, **rope)


op("rms_norm_mul_rope", 3, "rope(rms_norm(x, eps) * w, positions): per-head q/k norm then rotary (Qwen3)",
   {"eps": (float, REQUIRED), **_rope_params})((_rms_norm_mul_rope_infer, _rms_norm_mul_rope_ref))


def _rope_set_rows_infer(ts: list[Type], p: dict) -> Type:
    cache, x, pos, idx = ts
    roped = _rope_infer([x, pos], p)
    need(numel(roped[0][1:]) == numel(cache[0][1:]),
         f"a roped row {list(roped[0][1:])} does not fill a cache row {list(cache[0][1:])}")
    return _set_rows_infer([cache, ((x[0][0],) + cache[0][1:], x[1]), idx], p)


def _rope_set_rows_ref(cache, x, pos, idx, **rope) -> np.ndarray:
    y = OPS["rope"].ref(x, pos, **rope).reshape((x.shape[0],) + cache.shape[1:])
    return OPS["set_rows"].ref(cache, y, idx)


op("rope_set_rows", 4, "cache[idx[i]] = rope(x, positions)[i], in place (roped K straight into the KV cache)",
   _rope_params, writes=True)((_rope_set_rows_infer, _rope_set_rows_ref))


def _rms_norm_mul_rope_set_rows_infer(ts: list[Type], p: dict) -> Type:
    cache, x, w, pos, idx = ts
    _binary_infer([x, w], p)
    return _rope_set_rows_infer([cache, x, pos, idx], p)


def _rms_norm_mul_rope_set_rows_ref(cache, x, w, pos, idx, eps: float, **rope) -> np.ndarray:
    return _rope_set_rows_ref(cache, OPS["mul"].ref(_rms_norm(x, eps), w), pos, idx, **rope)


op("rms_norm_mul_rope_set_rows", 5,
   "cache[idx[i]] = rope(rms_norm(x, eps) * w, positions)[i], in place (Qwen3's normed, roped K into the KV cache)",
   {"eps": (float, REQUIRED), **_rope_params}, writes=True)(
    (_rms_norm_mul_rope_set_rows_infer, _rms_norm_mul_rope_set_rows_ref))


def _mul_mat_swiglu_infer(ts: list[Type], p: dict) -> Type:
    shape, dtype = OPS["mul_mat"].infer(ts, p)
    need(shape[-1] % 2 == 0, f"w has {shape[-1]} rows; gate and up halves need an even count")
    return shape[:-1] + (shape[-1] // 2,), dtype


def _mul_mat_swiglu_ref(w, x) -> np.ndarray:
    y = OPS["mul_mat"].ref(w, x)
    half = y.shape[-1] // 2
    return OPS["swiglu_split"].ref(y[..., :half], y[..., half:])


# The stacked gate|up projection and its activation: a GEMV computes a gate row and its up row
# together and stores only silu(gate) * up (one kernel, and the [.., 2F] product never stored).
op("mul_mat_swiglu", 2, "y = x @ w^T, F = half of w's rows: silu(y[..., :F]) * y[..., F:] (stacked gate|up weight)"
   )((_mul_mat_swiglu_infer, _mul_mat_swiglu_ref))


# ---------------------------------------------------------------- recurrent (Gated DeltaNet) fusions
def _ssm_conv_silu_infer(ts: list[Type], p: dict) -> list[Type]:
    return OPS["ssm_conv"].infer(ts, p)


def _ssm_conv_silu_ref(x, state, w):
    y, new_state = OPS["ssm_conv"].ref(x, state, w)
    return OPS["silu"].ref(y), new_state


op("ssm_conv_silu", 3,
   "(silu(y), new_state) where (y, new_state) = ssm_conv(x, state, w): the conv step of a DeltaNet/Mamba layer",
   multi=True)((_ssm_conv_silu_infer, _ssm_conv_silu_ref))


def _gdn_raw_infer(ts: list[Type], p: dict) -> list[Type]:
    q, k, v, alpha, b, a_neg, dt_bias, state = ts
    gate = _binary_infer([alpha, dt_bias], p)  # alpha + dt_bias, dt_bias [v_heads] broadcast over tokens
    _binary_infer([gate, a_neg], p)
    return OPS["gated_delta_net"].infer([q, k, v, gate, b, state], p)


def _gdn_raw_ref(q, k, v, alpha, b, a_neg, dt_bias, state, scale: float, l2_eps: float | None = None,
                steps: bool = False):
    if l2_eps is not None:
        q, k = OPS["l2_norm"].ref(q, eps=l2_eps), OPS["l2_norm"].ref(k, eps=l2_eps)
    g = OPS["mul"].ref(OPS["softplus"].ref(OPS["add"].ref(alpha, dt_bias)), a_neg)
    beta = OPS["sigmoid"].ref(b)
    return OPS["gated_delta_net"].ref(q, k, v, g, beta, state, scale=scale, steps=steps)


op("gated_delta_net_raw", 8,
   "gated_delta_net(q, k, v, g, beta, state) with the gates from raw projections: g = a_neg * softplus(alpha + "
   "dt_bias) (a_neg = -exp(A_log), llama.cpp's ssm_a), beta = sigmoid(b); with l2_eps, q and k are first "
   "l2_norm(., eps=l2_eps); returns (o, new_state), and with steps also S after each token [tokens, *state]",
   {"scale": (float, REQUIRED), "l2_eps": ((float, type(None)), None), "steps": (bool, False)},
   multi=True)((_gdn_raw_infer, _gdn_raw_ref))


def _rms_norm_mul_gate_infer(ts: list[Type], p: dict) -> Type:
    x, w, z = ts
    _binary_infer([x, w], p)
    need(z == x, f"gate z {list(z[0])} {z[1]} must match x {list(x[0])} {x[1]}")
    return x


def _rms_norm_mul_gate_ref(x, w, z, eps: float):
    return OPS["mul"].ref(OPS["mul"].ref(_rms_norm(x, eps), w), OPS["silu"].ref(z))


# Qwen3.5's gated output norm: the delta rule's output normalized per head, scaled, and gated by
# silu of the z projection.
op("rms_norm_mul_gate", 3, "rms_norm(x, eps) * w * silu(z) (w broadcast over the last axis, z shaped like x)",
   {"eps": (float, REQUIRED)})((_rms_norm_mul_gate_infer, _rms_norm_mul_gate_ref))


def _mul_sigmoid_infer(ts: list[Type], p: dict) -> Type:
    a, b = ts
    need(a == b, f"b {list(b[0])} {b[1]} must match a {list(a[0])} {a[1]} (no broadcast)")
    return _binary_infer([a, b], p)


def _mul_sigmoid_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return OPS["mul"].ref(a, OPS["sigmoid"].ref(b))


# Qwen3.5's gated attention: the attention output times sigmoid of the gate half of the q
# projection. One op, so the gate is read once (in place, as a strided view on the gpu) and
# sigmoid(gate) is never stored.
op("mul_sigmoid", 2, "a * sigmoid(b), elementwise (b shaped like a)")((_mul_sigmoid_infer, _mul_sigmoid_ref))

# Collectives (tensor parallel) live in their own module; importing it here registers them wherever the
# op table is imported.


# ---------------------------------------------------------------- reduced-precision matmul
def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return r.view(np.float32).reshape(np.shape(a))


def _mul_mat_bf16_infer(ts: list[Type], p: dict) -> Type:
    return OPS["mul_mat"].infer(ts, p)


def _mul_mat_bf16_ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return OPS["mul_mat"].ref(bf16_round(w), bf16_round(x))


# Produced by the gemm-bf16 pass for large matmuls: tensor cores run bf16 products at ~16x the f32
# rate. Its meaning is exact: round both operands to bf16, multiply, accumulate in f32.
op("mul_mat_bf16", 2, "mul_mat with w and x rounded to bfloat16 first (f32 accumulation and result)")(
    (_mul_mat_bf16_infer, _mul_mat_bf16_ref))


def _mul_mat_bf16_rounded_ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return bf16_round(_mul_mat_bf16_ref(w, x))


# Produced by the gemm-bf16-out pass where only an activation reads the product (prefill's gate and up):
# the result rounded to bf16 as HF transformers' bf16 projections leave it, so a backend can store it in
# half the bytes. A separate op, as flash_attn_bf16 below, so that no backend computes it without the rounding.
op("mul_mat_bf16_rounded", 2, "mul_mat_bf16, its f32 result then rounded to bfloat16 (ties to even)")(
    (_mul_mat_bf16_infer, _mul_mat_bf16_rounded_ref))



# ---------------------------------------------------------------- 8- and 16-bit activations (integer dot products)
Q8X_FORMATS = ("q4_0", "q4_1", "q8_0")  # weights whose integer codes a GEMV multiplies (gpu: q4_0, q8_0)
# With 16-bit x codes a block's integer sum is exact in int32 for all three: 32 * 128 * 32767 < 2^27 (q8_0); below
# 2^24, so exact as f32 too, for the 4-bit ones (32 * 15 * 32767, q4_1); q8_0's is rounded once to f32 (the cpu kernel).
Q16X_FORMATS = ("q4_0", "q4_1", "q8_0")
Q8_BLOCK = 32
_F32_TINY = np.finfo(np.float32).tiny  # 2^-126, the smallest normal f32


def int_blocks(x: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., n] (n % 32 == 0) rounded per 32-value block to integer codes q [..., n] (int64, |q| <= qmax) and
    f32 scales d [..., n / 32], x ~ d * q. In f32 as the kernels compute it: d = max |x| / qmax, q = roundf(x *
    (1 / d)), half away from zero, exactly (floor(|v| + 0.5) rounds 0.49999997 up). A block whose d is below
    2^-126 (every |x| < qmax * 2^-126) gets 1/d = 0, so zero codes: 1/d would overflow to inf."""
    b = np.asarray(x, np.float32).reshape(*np.shape(x)[:-1], -1, Q8_BLOCK)
    d = np.abs(b).max(axis=-1) / np.float32(qmax)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d >= _F32_TINY)
    v = b * inv[..., None]
    a = np.abs(v)
    f = np.floor(a)
    q = np.copysign(f + (a - f >= np.float32(0.5)), v)
    return q.astype(np.int64).reshape(np.shape(x)), d


def q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int_blocks with int8 codes (qmax 127: llama.cpp's q8_1 activations without the f16 scale)."""
    q, d = int_blocks(x, 127)
    return q.astype(np.int8), d


def q16_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int_blocks with int16 codes (qmax 32767)."""
    q, d = int_blocks(x, 32767)
    return q.astype(np.int16), d


def _int_x_infer(op_name: str, formats: tuple[str, ...], bits: int):
    def infer(ts: list[Type], p: dict) -> Type:
        (sw, dw), (sx, _) = ts
        need(len(sw) == 2, f"w {list(sw)} must be a 2-D weight [n_out, n_in]")
        need(dw in formats, f"w has dtype {dw}; {op_name} takes the integer codes of {', '.join(formats)}")
        need(sx[-1] % Q8_BLOCK == 0,
             f"x {list(sx)}: n_in {sx[-1]} is not a multiple of {Q8_BLOCK} (x's {bits}-bit blocks)")
        return OPS["mul_mat"].infer(ts, p)
    return infer


def _int_x_ref(blocks):
    def ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
        # w arrives dequantized: d_w * c (q4_0, q8_0) is exact in f32, so w * q summed over a block in float64 is
        # exactly d_w * (the integer sum of c * q) (at most 11 + 8 + 15 + 5 bits); the blocks' sum is then float64,
        # rounded once to f32. q4_1's d_w * c + m_w (f16 d and m, c < 16: 15 and 11 significant bits) is exact in
        # f32 whenever d's f16 ulp is at most 2^8 times m's and m's at most 2^12 times d's (the sum fits 24 bits;
        # times a 16-bit q and over 32 values 44 bits), and the block sum is then exactly d_w * (sum c q) + m_w *
        # (sum q): true of every weight of SmolLM2's file (106M) and of quant.random_quantized (checked 2026-12-01).
        q, d = blocks(x)
        n_out, n_in = w.shape
        wb = w.astype(np.float64).reshape(n_out, n_in // Q8_BLOCK, Q8_BLOCK)
        qb = q.astype(np.float64).reshape(*q.shape[:-1], 1, n_in // Q8_BLOCK, Q8_BLOCK)
        per_block = (wb * qb).sum(axis=-1)  # [..., n_out, n_blocks]
        return (per_block @ d[..., :, None].astype(np.float64))[..., 0].astype(np.float32)
    return ref


# Produced by the q8-activations pass for decode GEMVs of 4- and 8-bit weights: with x in 8-bit blocks
# the GPU multiplies integer codes with dp4a (~1 instruction a weight instead of ~3), the CPU with
# vpmaddubsw (backends/cpu/gemv_q8x.py). Its meaning is exact: x rounded by q8_blocks, y = sum over
# blocks of d_w d_x (sum c q), plus m_w d_x (sum q) for q4_1's min, the inner sums exact.
op("mul_mat_q8x", 2, "mul_mat of a q4_0 / q4_1 / q8_0 weight with x rounded to 8-bit blocks of 32 (q8_blocks): "
                     "y = sum_b d_w d_x (integer sum c q) [+ m_w d_x (integer sum q), q4_1]")(
    (_int_x_infer("mul_mat_q8x", Q8X_FORMATS, 8), _int_x_ref(q8_blocks)))

# Produced by the q16-activations pass (cpu only): 8-bit x moves SmolLM2's top-2 logit margin by a median 0.066,
# past issue 13's near-tie 0.05; ~12-bit x stays below it (BENCHMARKS.md). With int16 codes the cpu multiplies
# with vpmaddwd (backends/cpu/gemv_q16x.py). Its meaning: mul_mat_q8x's with x rounded by q16_blocks.
op("mul_mat_q16x", 2, "mul_mat of a q4_0 / q4_1 / q8_0 weight with x rounded to 16-bit blocks of 32 (q16_blocks): "
                      "y = sum_b d_w d_x (integer sum c q) [+ m_w d_x (integer sum q), q4_1]")(
    (_int_x_infer("mul_mat_q16x", Q16X_FORMATS, 16), _int_x_ref(q16_blocks)))

# ---------------------------------------------------------------- reduced-precision attention
LOG2E = 1.4426950408889634


def _flash_attn_bf16_infer(ts: list[Type], p: dict) -> Type:
    return OPS["flash_attn"].infer(ts, p)


def _flash_attn_bf16_ref(q, k, v, pos, kv_len, scale: float, window: int) -> np.ndarray:
    n_kv, hk, _ = k.shape
    length = int(kv_len[0])
    need(0 <= length <= n_kv, f"flash_attn_bf16: kv_len {length} outside 0..{n_kv} (the KV capacity)")
    j = np.arange(length)
    allowed = j[None, :] <= pos[:, None]  # causal, windowed: flash_attn's rule
    if window:
        allowed &= pos[:, None] - j[None, :] < window
    group = q.shape[1] // hk
    kk = np.repeat(bf16_round(k[:length].astype(np.float32)), group, axis=1)  # [L, hq, d]
    vv = np.repeat(bf16_round(v[:length].astype(np.float32)), group, axis=1)
    s = np.einsum("qhd,khd->hqk", bf16_round(q.astype(np.float32)), kk) * np.float32(scale * LOG2E)
    s = np.where(allowed[None], s, -np.inf)  # scores in the log2 domain, f32
    m = np.ceil(s.max(axis=-1, keepdims=True, initial=-np.inf))
    m = np.where(np.isfinite(m), m, 0.0)
    weights = bf16_round(np.exp2(s - m))  # in (1/2, 1] at the max; 0 where masked
    denom = weights.sum(axis=-1, keepdims=True)
    prob = np.divide(weights, denom, out=np.zeros_like(weights), where=denom > 0)
    return np.einsum("hqk,khd->qhd", prob, vv).astype(np.float32)


# Produced by the attn-bf16 pass for prefill attention, run on tensor cores. A separate op (as
# mul_mat_bf16) rather than a flash_attn param: a backend without a rule for it cannot quietly
# compute the f32 meaning, and dumps show the precision change by name. Its meaning is exact up
# to f32 summation order: q, k, v rounded to bf16, scores in f32; the softmax weights enter the
# weighted sum of v in bf16 (the tensor cores' operand type), taken relative to a power of two
# M = ceil(max score * log2 e), so a kernel that raises its running maximum M tile by tile
# rescales by exact powers of two and rounds every weight exactly as here; normalized by the
# sum of the rounded weights.
op("flash_attn_bf16", 5,
   "flash_attn with q, k, v rounded to bfloat16 and the softmax weights 2^(s*log2e - M) rounded to bfloat16 "
   "(M = ceil of the row's max, s = q.k*scale in f32), normalized by their sum; f32 result",
   {"scale": (float, REQUIRED), "window": (int, 0)})((_flash_attn_bf16_infer, _flash_attn_bf16_ref))
