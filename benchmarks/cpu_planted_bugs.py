"""Plant plausible bugs in the cpu backend, the passes and the speculative loop, and check that the tests catch
each one (the cpu counterpart of gpu_planted_bugs.py; no GPU needed).

    python benchmarks/cpu_planted_bugs.py [N ...]      # all bugs, or only the numbered ones

Each bug is one textual edit (an off-by-one, a dropped eps, a swapped operand, a rule loosened), planted and tested
by planted.py (beside this script): a line per bug, CAUGHT or MISSED. Each run compiles the kernels its tests use in
a fresh numba cache, so a bug takes 0.5-3 minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planted import run  # noqa: E402  (beside this script)

K, A = "backends/cpu/kernels.py", "backends/cpu/attention.py"
# (what, source from the repository root, text, its buggy replacement, test files, pytest -k)
BUGS = [
    ("add_rms_norm_mul drops eps", K,
     "inv = np.float32(1.0) / np.sqrt(acc / a.shape[1] + np.float32(eps))",
     "inv = np.float32(1.0) / np.sqrt(acc / a.shape[1])",
     "tests/test_ops.py", "add_rms_norm_mul and cpu"),
    ("rope turns the other way (the sine's sign)", K,
     "dst[h, i0] = a * c - b * s", "dst[h, i0] = a * c + b * s",
     "tests/test_ops.py", "rope and cpu"),
    ("swiglu multiplies silu(gate) by gate, not up", K,
     "out[r, c0 + i] = a[r, c0 + i] / (np.float32(1.0) + poly[i] * pow2[i]) * b[r, c0 + i]",
     "out[r, c0 + i] = a[r, c0 + i] / (np.float32(1.0) + poly[i] * pow2[i]) * a[r, c0 + i]",
     "tests/test_ops.py", "swiglu and cpu"),
    ("set_rows lets a row index equal to the capacity through", K,
     "if row < 0 or row >= dst.shape[0]:\n            raise IndexError(\"set_rows: row index out of range\")\n"
     "        for i in range(src.shape[1]):\n            dst[row, i] = src[r, i]",
     "if row < 0 or row > dst.shape[0]:\n            raise IndexError(\"set_rows: row index out of range\")\n"
     "        for i in range(src.shape[1]):\n            dst[row, i] = src[r, i]",
     "tests/test_ops.py", "set_rows and cpu"),
    ("decode attention's last chunk ends a key early", A,
     "start + (stop - start) * (c + 1) // own",
     "start + (stop - start) * (c + 1) // own - (c + 1 == own and stop - start > 1)",
     "tests/test_cpu_attention.py", ""),
    ("decode attention's merge leaves the first chunk out", A,
     "                    f = np.float32(np.exp(max_[t, h, c] - top))",
     "                    f = np.float32(np.exp(max_[t, h, c] - top)) * np.float32(c > 0)",
     "tests/test_cpu_attention.py", ""),
    ("a verify call's query is cut into chunks by the call's length, not its own position", A,
     "own = _splits(min(length, pos[t] + 1), capacity_splits)", "own = _splits(length, capacity_splits)",
     "tests/test_cpu_attention.py tests/test_speculative.py", "bitwise"),
    ("the 16-bit-x q4_0 GEMV (AVX2) drops the codes' -8", "backends/cpu/gemv_q16x.py",
     "codes = [[builder.sub(c, const(8)) for c in pair] for pair in codes]", "codes = [list(pair) for pair in codes]",
     "tests/test_cpu_gemv_q16x.py", ""),
    ("the 16-bit-x q4 GEMV (AVX2) swaps the second block's even and odd codes", "backends/cpu/gemv_q16x.py",
     "codes = [[nib(0), nib(8)], [nib(4), nib(12)]]", "codes = [[nib(0), nib(8)], [nib(12), nib(4)]]",
     "tests/test_cpu_gemv_q16x.py", ""),
    ("stack-projections' column views start a row early after the first weight", "graphir/passes/stack.py",
     "start[w.name], offset = offset, offset + w.shape[0]",
     "start[w.name], offset = max(0, offset - 1), offset + w.shape[0]",
     "tests/test_passes.py", "stack or keeps_values"),
    ("greedy acceptance keeps the first draft even where the target disagrees", "graphir/speculative.py",
     "while a < len(drafts) and drafts[a] == target_ids[a]:",
     "while a < len(drafts) and (drafts[a] == target_ids[a] or a == 0):",
     "tests/test_speculative.py", "greedy and not gpu and not smollm2"),
    ("prompt lookup proposes from one token after the match", "graphir/speculative.py",
     "return Draft([int(t) for t in ctx[s + n:s + n + k]])",
     "return Draft([int(t) for t in ctx[s + n + 1:s + n + 1 + k]])",
     "tests/test_speculative.py", "lookup and not gpu and not smollm2"),
    ("replay-lint lets a KV view spanning all but one row of the pool through", "graphir/passes/replay_lint.py",
     "if (rows := _rows_spanned(n, pool)) < pool.shape[0]:", "if (rows := _rows_spanned(n, pool)) < pool.shape[0] - 1:",
     "tests/test_replay_lint.py tests/test_kv_slots.py", "lint or baked or seed or one_row_short"),
    ("fuse-add-rms-norm-mul matches const norm weights only, never a model graph's Params",
     "graphir/passes/fuse_norm.py",
     "    if weight is norm or mul.shape != norm.shape:\n        rw.reject(add,",
     "    if weight is norm or mul.shape != norm.shape or weight.op == \"param\":\n        rw.reject(add,",
     "tests/test_passes.py", "fuse-add-rms-norm-mul or fuses_model"),
    ("the Program cache's key leaves the pass pipeline out", "graphir/cache.py",
     "key = (graph.signature(), id(weights), backend, passes)", "key = (graph.signature(), id(weights), backend)",
     "tests/test_program_cache.py", ""),
    ("the passed-graph cache's key leaves the pass pipeline out", "graphir/cache.py",
     "key = (graph.signature(), passes)\n", "key = (graph.signature(), \"\")\n",
     "tests/test_program_cache.py", "two_pipelines or passed"),
    ("f16 KV rows round ties up, not to even", "backends/cpu/kv_f16.py",
     "if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and (h & np.uint32(1))):",
     "if rest >= np.uint32(0x1000):",
     "tests/test_kv_f16.py", ""),
    ("the weight cache's code hash leaves out gemv_q8x.py, whose repack the 8- and 16-bit-x GEMVs read",
     "backends/cpu/weight_cache.py",
     '_CODE = ("weight_cache.py", "gemv_repacked.py", "gemv_q8x.py", "matmul.py")',
     '_CODE = ("weight_cache.py", "gemv_repacked.py", "matmul.py")',
     "tests/test_cpu_weight_cache.py", ""),
    ("the last token id of the vocabulary is refused", "graphir/api.py",
     "bad = np.flatnonzero((ids < 0) | (ids >= self.config.n_vocab))",
     "bad = np.flatnonzero((ids < 0) | (ids >= self.config.n_vocab - 1))",
     "tests/test_api_errors.py tests/test_generate.py", ""),
    ("the delta rule scales v by beta but not the memory it replaces", "graphir/ops/core.py",
     "delta = (v[t] - kv_mem) * beta[t][:, None]", "delta = v[t] * beta[t][:, None] - kv_mem",
     "tests/test_delta_rule.py tests/test_qwen35.py", "not gpu"),
    ("the q8_0 quantizer scales blocks by 128, not 127", "graphir/quant.py",
     "d = np.abs(x).max(axis=-1, keepdims=True) / _F32(127)", "d = np.abs(x).max(axis=-1, keepdims=True) / _F32(128)",
     "tests/test_quant.py", ""),
    ("Llama's attention scale is 1 / head_dim, not its square root", "models/llama.py",
     "scale=1.0 / math.sqrt(c.head_dim)", "scale=1.0 / c.head_dim",
     "tests/test_models_hf.py", "llama or Llama"),
    ("a slot pool's rewind keeps the last position's slot (a slot leaks)", "graphir/kv_slots.py",
     "self.free[:0] = self.slot_map[n:self.held].tolist()", "self.free[:0] = self.slot_map[n:self.held - 1].tolist()",
     "tests/test_kv_slots.py", "not gpu"),
    ("a GGUF file's tensor data is read from the header's end, not the next alignment boundary", "models/gguf_file.py",
     "self.data_offset = -(-cur.pos // self.alignment) * self.alignment", "self.data_offset = cur.pos",
     "tests/test_gguf_file.py", ""),
    ("the memory plan frees a buffer at its last reader, which may then write over it", "graphir/memplan.py",
     "live = [s for s in live if s.last >= i]", "live = [s for s in live if s.last > i]",
     "tests/test_memplan.py tests/test_cpu_models.py", "plan or early_output or tiny_presets"),
    ("the memory plan does not keep a graph's outputs live to the end", "graphir/memplan.py",
     "        last[storage_of(out, alias)] = end", "        pass",
     "tests/test_memplan.py tests/test_cpu_models.py", "memplan or early_output or plan or tiny_presets"),
    ("an EOS id is yielded before the loop ends", "graphir/generate.py",
     "        if stop_at_eos and token in eos_ids:\n            return\n        yield token",
     "        yield token\n        if stop_at_eos and token in eos_ids:\n            return",
     "tests/test_generate.py tests/test_cli.py", "eos"),
    ("a per-step int loses its taint through floor division", "graphir/taint.py",
     '"__mul__", "__rmul__", "__floordiv__",', '"__mul__", "__rmul__",',
     "tests/test_replay_lint.py", ""),
    ("sampling divides logits by the temperature's square", "graphir/ops/core.py",
     "w = np.exp((x[order] - x[order[0]]) / temperature)", "w = np.exp((x[order] - x[order[0]]) / temperature ** 2)",
     "tests/test_ops.py tests/test_cpu_sample.py", "sample"),
]


def main() -> None:
    run(BUGS, set(sys.argv[1:]))


if __name__ == "__main__":
    main()
