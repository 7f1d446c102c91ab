"""Where a bf16 Qwen3.5 differs from HF transformers: our logits against HF's in f32 and in bf16.

    python benchmarks/hf_precision_qwen35.py [--layers 8] [--tokens 48]

A Qwen3.5-0.8B-shaped random model (vocabulary cut to 4096, `--layers` layers, bf16 weights) runs on
the cpu backend (f32 activations) and as HF's Qwen3_5ForCausalLM built from the same tensors
(`config_to_hf`, `tensor_to_hf`), once with f32 and once with bf16 parameters and activations. It
prints max |diff| / max |logit| of the last position for each pair: what separates us from HF's
bf16 run (as `graphir bench --compare hf` measures it) and how much of that HF's own bf16 causes.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    import torch
    import transformers
    from graphir.models import presets, qwen35

    from graphir.api import Model
    from graphir.quant import dequantize

    cfg = dataclasses.replace(qwen35.PRESETS["qwen35-0.8b"][0], n_layers=args.layers, n_vocab=4096, ctx=256)
    weights = qwen35.random_weights(cfg, "bf16")
    ids = list(np.random.default_rng(0).integers(0, cfg.n_vocab, args.tokens))
    ours = Model(cfg, weights, presets.ByteTokenizer(), backend="cpu", passes="default").logits(ids)[-1]
    family, hf_cfg = qwen35.FAMILY, dict(qwen35.FAMILY.config_to_hf(cfg))
    model_type = hf_cfg.pop("model_type")
    theirs = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **hf_cfg),
                                                           dtype=dtype)
        state = {}
        for n, w in weights.items():
            a = family.tensor_to_hf(n, np.asarray(dequantize(w.data, w.dtype, w.shape), np.float32))
            state[family.hf_names.to_file(n)] = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        hf.load_state_dict(state, strict=False)
        hf.config._attn_implementation = "eager"
        with torch.no_grad():
            theirs[name] = hf.eval()(torch.tensor([ids])).logits[0, -1].float().numpy()
    scale = float(np.abs(theirs["f32"]).max())
    for what, a, b in (("graphir (cpu) vs HF f32", ours, theirs["f32"]), ("HF bf16 vs HF f32", theirs["bf16"],
                       theirs["f32"]), ("graphir (cpu) vs HF bf16", ours, theirs["bf16"])):
        print(f"{what:<26} {float(np.abs(a - b).max()) / scale:.2e}")


if __name__ == "__main__":
    main()
