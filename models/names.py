"""Renaming file tensor names to our Param names and back, for every model family.

An HF checkpoint names a tensor either globally (`model.norm.weight`) or per layer
(`model.layers.3.self_attn.q_proj.weight`); our Params are GGUF-style (`output_norm.weight`,
`blk.3.attn_q.weight`). A family supplies the two tables; this module does the mapping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")

# The parts of the tables every HF *ForCausalLM decoder names alike: the embedding, final norm and head,
# and in each layer the attention projections (with Qwen3 / Gemma's per-head q/k norms) and the gated MLP.
HF_CAUSAL_LM_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_SELF_ATTN = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
HF_MLP = {
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


class NameMap:
    def __init__(self, global_names: Mapping[str, str], layer_names: Mapping[str, str]):
        self.global_names = dict(global_names)
        self.layer_names = dict(layer_names)
        self._global_back = {ours: hf for hf, ours in self.global_names.items()}
        self._layer_back = {ours: hf for hf, ours in self.layer_names.items()}

    def to_ours(self, name: str) -> str | None:
        """Our Param name for a file tensor name, or None if the graph has no place for it."""
        if name in self.global_names:
            return self.global_names[name]
        m = _HF_LAYER_NAME.fullmatch(name)
        if m and m.group(2) in self.layer_names:
            return f"blk.{m.group(1)}.{self.layer_names[m.group(2)]}"
        return None

    def to_file(self, name: str) -> str:
        """The file tensor name of one of our Param names (for error messages and test files)."""
        if name in self._global_back:
            return self._global_back[name]
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}.{self._layer_back[rest]}"
