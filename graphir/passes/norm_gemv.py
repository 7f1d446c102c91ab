"""fuse-norm-gemv: a decode step's add + rms_norm taken into the GEMVs on either side of it.

After the default fusions a decoder layer's step still runs add_rms_norm_mul as a kernel of its own
twice (before attention and before the FFN), between a GEMV that produced one of its operands and the
GEMVs that read its normalized result. Both halves move into those GEMVs:
  - the residual add becomes the producing GEMV's epilogue: add(r, mul_mat(w, x)) -> mul_mat_add(w, x, r),
    one value a row;
  - the norm's one scalar a token, 1 / sqrt(mean(s^2) + eps), is computed by each reading GEMV from the
    x values it loads anyway, which it multiplies by the norm weight as it goes:
    mul_mat(w, rms_norm(s) * nw) -> rms_norm_mul_mat(w, s, nw) (mul_mat_swiglu: rms_norm_mul_mat_swiglu).
A Qwen3-8B decode step loses 72 of its 366 kernels (~2.3 us each on an H200, BENCHMARKS.md).

Where it applies: the normalized rows are read only by mul_mats (or mul_mat_swiglu) of 2-D weights in
`formats` by at most `max_rows` rows (the decode step; verify calls and prefill keep the separate norm,
which their GEMMs read once for many rows). The add is fused only into a mul_mat of that kind that nothing
else reads; otherwise the match is rejected and add_rms_norm_mul stays. The plain norm with no add before
it (a model's first layer) is mul(rms_norm(x), nw) and fuses the same way. `formats` are those whose gpu
decode GEMV has the fused variants (matmul.cu gemv1v2 with NORM / RES); the q4_0 / q8_0 GEMVs stage x
differently and would fall back to separate kernels, which is slower than the fused add + norm kept here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphir.ir import Graph, Node
from graphir.passes import register_pass
from graphir.passes.rewrite import Rewriter, is_weight_matrix, rewrite

PRODUCTS = {"mul_mat": "rms_norm_mul_mat", "mul_mat_swiglu": "rms_norm_mul_mat_swiglu"}


@register_pass("fuse-norm-gemv", "add_rms_norm_mul (or mul(rms_norm(x), w)) whose normalized rows only decode GEMVs "
                                 "read -> the norm inside each GEMV (rms_norm_mul_mat[_swiglu]) and the add in the "
                                 "epilogue of the GEMV that produced an operand (mul_mat_add)")
@dataclass(frozen=True)
class FuseNormGemv:
    max_rows: int = 1
    formats: str = "f32,f16,bf16"

    def _gemv(self, n: Node, x: Node) -> bool:
        """n is a decode GEMV of a weight in `formats` reading x as its activation."""
        w = n.src[0]
        return (n.op in PRODUCTS and n.src[1] is x and is_weight_matrix(w) and w.dtype in self.formats.split(",")
                and math.prod(x.shape[:-1]) <= self.max_rows)

    def _readers(self, normed: Node, rw: Rewriter) -> list[Node] | None:
        readers = rw.users(normed)
        if not readers or any(r is normed for r in rw.graph.roots):
            return None
        bad = next((r for r in readers if not self._gemv(r, normed)), None)
        if bad is not None:
            rw.reject(normed, f"{bad.op} {bad.name or ''} reads the normalized rows: not a decode GEMV of a "
                              f"{self.formats} weight over <= {self.max_rows} rows, so the norm stays")
            return None
        return readers

    def _match(self, n: Node, rw: Rewriter) -> tuple | None:
        if n.op == "add_rms_norm_mul":
            items = {u.params["index"]: u for u in rw.users(n) if u.op == "item"}
            normed, total = items.get(0), items.get(1)
            if normed is None or len(items) != len(rw.users(n)):
                return None
            readers = self._readers(normed, rw)
            if readers is None:
                return None
            a, b, nw = n.src
            for r, mm in ((a, b), (b, a)):
                if (mm.op == "mul_mat" and rw.sole_user(mm) is n and self._gemv(mm, mm.src[1])
                        and (r.shape, r.dtype) == (mm.shape, mm.dtype)):
                    return n, readers, total, (mm, r), nw
            rw.reject(n, "neither operand is a decode GEMV read only by this add; add_rms_norm_mul stays")
            return None
        if n.op == "mul" and any(s.op == "rms_norm" for s in n.src):
            norm = next(s for s in n.src if s.op == "rms_norm")
            nw = n.src[1] if n.src[0] is norm else n.src[0]
            if len(nw.shape) != 1 or nw.shape != norm.shape[-1:]:
                return None
            readers = self._readers(n, rw)
            return None if readers is None else (n, readers, None, None, nw)
        return None

    def _rewrite(self, m: tuple, rw: Rewriter) -> Node:
        n, readers, total, residual, nw = m
        if residual is None:  # mul(rms_norm(x), nw): x is read as it is
            norm = next(s for s in n.src if s.op == "rms_norm")
            x, eps = norm.src[0], norm.params["eps"]
        else:
            (mm, r), eps = residual, n.params["eps"]
            x = rw.make("mul_mat_add", mm.src[0], mm.src[1], r, name=total.name if total is not None else None)
            rw.matched(n, "mul_mat_add")
            if total is not None:
                rw.replace(total, x)
        for u in readers:
            rw.matched(u, PRODUCTS[u.op])
            rw.replace(u, rw.make(PRODUCTS[u.op], u.src[0], x, nw, name=u.name, eps=eps))
        return rw.rebuild(n)  # read by nothing now: dce removes it

    def __call__(self, graph: Graph) -> Graph:
        return rewrite(graph, [(self._match, self._rewrite)])
