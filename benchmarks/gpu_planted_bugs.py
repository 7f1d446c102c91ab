"""Plant plausible bugs in the GPU kernels and check that the GPU tests catch each one.

    python benchmarks/gpu_planted_bugs.py [N ...]      # all bugs, or only the numbered ones

Each bug is one textual edit of a kernel source in backends/gpu (an off-by-one, a dropped eps, a swapped stride),
planted and tested by planted.py (beside this script): a line per bug, CAUGHT, MISSED or NOT RUN (no GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planted import run  # noqa: E402  (beside this script)

# (what, kernel source in backends/gpu, text, its buggy replacement, test files, pytest -k)
BUGS = [
    ("add_rms_norm_mul register kernel drops eps", "norm.cu",
     "const float inv = 1.0f / sqrtf(ss / (float)ncols + eps);\n#pragma unroll",
     "const float inv = 1.0f / sqrtf(ss / (float)ncols);\n#pragma unroll",
     "tests/test_ops.py", "add_rms_norm_mul and gpu"),
    ("add_rms_norm_mul register kernel skips a row's last float4", "norm.cu",
     "        if (c < n4) {\n            const row4 x", "        if (c < n4 - 1) {\n            const row4 x",
     "tests/test_ops.py", "add_rms_norm_mul and gpu"),
    ("gemvm drops its last warp's partial sum", "matmul.cu",
     "for (int k = 0; k < G / 32; ++k) s += part[grp][k][r][t];",
     "for (int k = 0; k < G / 32 - 1; ++k) s += part[grp][k][r][t];",
     "tests/test_gpu_matmul.py", "gemvm"),
    ("gemvmsw reads the up rows one row late", "matmul.cu",
     "wr[r] = W + (long long)(SW && r >= OUT ? n_out + o : o) * row_bytes;",
     "wr[r] = W + (long long)(SW && r >= OUT ? n_out + o + (o + 1 < n_out) : o) * row_bytes;",
     "tests/test_gpu_matmul.py", "swiglu_verify"),
    ("merged q/K/V kernel starts V's elements a block late", "rope.cu",
     "v_s1, \\\n                         (long long)(blockIdx.x - (b0)) * blockDim.x + threadIdx.x,",
     "v_s1, \\\n                         (long long)(blockIdx.x - (b0) + 1) * blockDim.x + threadIdx.x,",
     "tests/test_gpu_backend.py", "q_k_v_writes or tiny_models"),
    ("set_rows reads the token stride as the head stride", "rope.cu",
     "STORE(src[o0 * s0 + (o - o0 * d1) * s1 + (i - o * inner)])",
     "STORE(src[o0 * s1 + (o - o0 * d1) * s1 + (i - o * inner)])",
     "tests/test_gpu_strided.py", "rope_kernels"),  # a view whose heads do not merge into its rows
    ("the 16-byte set_rows reads the token stride as the head stride", "rope.cu",
     "*(const f32x4*)(src + o0 * s0 + (o - o0 * d1) * s1 + (i - o * inner))",
     "*(const f32x4*)(src + o0 * s1 + (o - o0 * d1) * s1 + (i - o * inner))",
     "tests/test_gpu_strided.py", "rope_kernels"),
    ("the 16-byte K/V conversion reads a piece's first float4 twice", "attention_prefill.cu",
     "b = ((const f32x4*)p)[1];", "b = ((const f32x4*)p)[0];",
     "tests/test_gpu_attention_prefill.py", "prefill_from_empty_cache"),
    ("the wide norm-rope wraps a row's head late", "rope.cu",
     "            if (hr >= hb) {", "            if (hr > hb) {",
     "tests/test_gpu_rope.py", "rows_per_group"),
    ("attn_combine drops the last partial split", "attention.cu",
     "const int na = cdiv_i(Ls, chunk);", "const int na = Ls / chunk;",
     "tests/test_gpu_attention.py", "decode"),
    ("the 16-byte bf16 cast drops the n % 4 tail", "matmul.cu",
     "if (first < n - 4 * n4) y[4 * n4 + first] = f32_to_bf16(x[4 * n4 + first]);",
     "if (first < n - 4 * n4 - 1) y[4 * n4 + first] = f32_to_bf16(x[4 * n4 + first]);",
     "tests/test_gpu_backend.py", "cast"),
    ("the 16-byte swiglu swaps gate and up", "elementwise.cu",
     "silu_mul(x.x, u.x), silu_mul(x.y, u.y)", "silu_mul(u.x, x.x), silu_mul(x.y, u.y)",
     "tests/test_gpu_backend.py", "swiglu_split"),
    ("the strided swiglu reads up with gate's row stride", "elementwise.cu",
     "u = ((const f32x4*)(b + t * sb))[c];", "u = ((const f32x4*)(b + t * sa))[c];",
     "tests/test_gpu_strided.py", "swiglu"),
    ("the bf16 norm twin swaps two columns", "norm.cu",
     "u16x4{f32_to_bf16(v.x), f32_to_bf16(v.y),", "u16x4{f32_to_bf16(v.y), f32_to_bf16(v.x),",
     "tests/test_gpu_backend.py", "bf16_twins"),
    ("prefill attention rescales O only when a row group's first row moved", "attention_prefill.cu",
     "alpha[0] != 1.0f || alpha[1] != 1.0f", "alpha[0] != 1.0f",
     "tests/test_gpu_attention_prefill.py", "prefill_from_empty_cache"),
    ("the dp4a GEMV drops q4_0's -8 (the block's sum of x codes)", "gemv_q8x.cu",
     "(unsigned)(OFFSET * s)", "0u", "tests/test_gpu_gemv_q8x.py", "host or geometry"),
    ("the staged GEMVs' short last chunk stages one 16-byte piece too few (RowChunks)", "quant.cuh",
     "return ((nb - c0 < CB ? nb - c0 : CB) * BB + 15) / 16; }",
     "return ((nb - c0 < CB ? nb - c0 : CB) * BB + 15) / 16 - (nb - c0 < CB); }",
     "tests/test_gpu_gemv_q8x.py tests/test_gpu_matmul.py", "host or geometry or gemv1_variants"),
    ("the tensor-core q4_0 GEMV subtracts 1024, not 1032, from the low codes (their -8 dropped)", "gemv_tc.cu",
     "const unsigned k1032 = 0x64086408u;", "const unsigned k1032 = 0x64006400u;",
     "tests/test_gpu_gemv_tc.py", "product or accuracy"),
    ("the tensor-core q4_0 GEMV drops x's low f16 half", "gemv_tc.cu",
     "b[s][h] = lo ? pack_f16x2(y0 - f16_lo(hi), y1 - f16_hi(hi)) : hi;", "b[s][h] = lo ? 0u : hi;",
     "tests/test_gpu_gemv_tc.py", "accuracy"),
    ("the tensor-core q4_0 GEMV scales row g by row g+8's d", "gemv_tc.cu",
     "acc[i][0] = fmaf(dg, c[0] + c[1], acc[i][0]);", "acc[i][0] = fmaf(dg8, c[0] + c[1], acc[i][0]);",
     "tests/test_gpu_gemv_tc.py", "product or accuracy"),
    ("the q4_0 repacking swaps two nibble slots of each word", "gemv_tc.cu",
     "const int slot_off[8] = {0, 0, 2, 2, 1, 1, 3, 3};", "const int slot_off[8] = {0, 0, 1, 1, 2, 2, 3, 3};",
     "tests/test_gpu_gemv_tc.py", "layout"),
    ("attn_combine adds the rows it loads before the maxima one split group late", "attention.cu",
     "const int sp = sg + CSG * i;", "const int sp = sg + CSG * (i + 1);",
     "tests/test_gpu_attention.py", "decode"),
    ("decode attention cuts a verify call's queries by the call's kv_len, not their own positions", "attention.cu",
     "DEVICE int split_len(int p, int L) { return p >= 0 && p < L ? p + 1 : L; }",
     "DEVICE int split_len(int p, int L) { return L; }",
     "tests/test_speculative.py", "gpu_verify_rows"),
    ("the 2..16-token float GEMV adds a unit's two runs one after the other, not their sum", "matmul.cu",
     "for (int r = 0; r < NR; ++r) dot8<true>(a, c, v[i][r], 1.0f, 1.0f, acc[r * M + t]);",
     "for (int r = 0; r < NR; ++r) dot8<false>(a, c, v[i][r], 1.0f, 1.0f, acc[r * M + t]);",
     "tests/test_speculative.py", "gpu_verify_rows"),
    ("a verify call's decode-GEMV blocks read token t's x n_out floats apart, not n_in", "common.cuh",
     "X += (long long)((int)blockIdx.x - bx * m) * n_in;", "X += (long long)((int)blockIdx.x - bx * m) * n_out;",
     "tests/test_gpu_matmul.py", "quantized_weights_are"),
    ("the 2..16-token products of a quantized weight go back to gemv_<fmt> (the lowering)", "matmul.py",
     'return GEMVM_KERNEL == "exact" and 1 < m <= GEMV_MAX_TOKENS', 'return GEMVM_KERNEL == "never" and 1 < m',
     "tests/test_speculative.py", "gpu_verify_rows and q4_0"),
    ("a verify call's attention blocks stop one split short of n_split (the walk kernels)", "attention.cu",
     "for (int s = blockIdx.x; s < n_split; s += gridDim.x) BODY",
     "for (int s = blockIdx.x; s + 1 < n_split; s += gridDim.x) BODY",
     "tests/test_gpu_attention.py", "every_class"),
    ("a verify GEMV's second token group writes its rows one token early (GEMVM_TOKEN_GROUP)", "matmul.cu",
     "Y += (long long)t0_ * n_out;", "Y += (long long)(t0_ - (t0_ > 0)) * n_out;",
     "tests/test_speculative.py", "gpu_verify_rows"),
    ("the fused tensor-core gate|up + swiglu reads the gate sums as the up sums", "gemv_tc.cu",
     "up += part[w][16 + threadIdx.x];", "up += part[w][threadIdx.x];",
     "tests/test_gpu_gemv_tc.py", "swiglu"),
    ("the fused tensor-core gate|up + swiglu pairs gate tile i with up tile i - 1", "gemv_tc.cu",
     "const int stride = SW ? n_out / 16 : 1;", "const int stride = SW ? n_out / 16 - 1 : 1;",
     "tests/test_gpu_gemv_tc.py", "swiglu"),
]


def main() -> None:
    run([(what, f"backends/gpu/{source}", *rest) for what, source, *rest in BUGS], set(sys.argv[1:]))


if __name__ == "__main__":
    main()
