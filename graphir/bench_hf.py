"""`graphir bench --compare hf`: HF transformers on the same model, on the same GPU, in the same run.

The model's weights (random presets included) are copied into the HF model of the same shapes
(the family's `config_to_hf` and tensor names), in bfloat16 as HF serves them. Two HF setups run:
eager (the default dynamic cache) and a static cache with `torch.compile(mode="reduce-overhead")`
(CUDA graphs), the usual fast path of transformers. Each reports prefill and greedy decode tok/s
measured the way graphir's are, and the largest difference of its last-position logits from
graphir's on the prompt (relative to graphir's largest logit): a wrong weight mapping shows there
as a difference near 1, bf16 rounding as ~1e-2.

torch and transformers are not dependencies; without them (or without a CUDA device) the result
is None and the note says why.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from graphir.bench import _rates
from graphir.errors import GraphirError
from graphir.quant import dequantize


def hf_peers(model: Any, prefill: list[int], prompt: list[int], decode_tokens: int, repeats: int,
             compiled: bool = True) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str]:
    """(eager results, static+compile results or None when `compiled` is off, note)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None, None, "torch and transformers are not installed: no HF comparison"
    if not torch.cuda.is_available():
        return None, None, "torch sees no CUDA device: no HF comparison"
    from graphir.models.registry import family_of

    family = family_of(model.config)
    if family.config_to_hf is None:
        return None, None, f"the {family.name} family has no HF mapping: no HF comparison"
    try:
        hf_config = dict(family.config_to_hf(model.config))
    except GraphirError as e:
        return None, None, f"no HF comparison: {e}"
    try:  # a transformers release without this model type, or one that reads the config differently
        cfg = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
        with torch.device("cuda"):
            hf = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return None, None, f"no HF comparison: transformers {transformers.__version__} cannot build it ({e})"
    state = {}
    for name, w in model.weights.items():
        a = np.asarray(dequantize(w.data, w.dtype, w.shape), np.float32)
        if family.tensor_to_hf is not None:
            a = family.tensor_to_hf(name, a)
        state[family.hf_names.to_file(name)] = torch.from_numpy(np.ascontiguousarray(a)).to("cuda", torch.bfloat16)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        return None, None, f"no HF comparison: tensors missing {missing[:3]}, unexpected {unexpected[:3]}"
    del state
    hf.eval()

    model.reset()
    ours = np.asarray(model.feed(prompt, last_only=True)[-1], np.float64)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        theirs = hf(ids).logits[0, -1].float().cpu().numpy()
    logits_diff = float(np.abs(theirs - ours).max() / np.abs(ours).max())

    def measure(m: Any) -> dict[str, Any]:
        def sync_time(fn) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            # a new step for torch.compile's CUDA graphs: the last call's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        pre = torch.tensor([prefill], device="cuda")
        one = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
        many = dict(max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1, do_sample=False,
                    pad_token_id=0)
        with torch.no_grad():
            for _ in range(2):  # warm-up: kernels, and the compiled path's graphs
                for kw in (one, many):
                    torch.compiler.cudagraph_mark_step_begin()
                    m.generate(ids, **kw)
            prefill_s = [sync_time(lambda: m(pre)) for _ in range(repeats)]
            first = min(sync_time(lambda: m.generate(ids, **one)) for _ in range(repeats))
            decode_s = [sync_time(lambda: m.generate(ids, **many)) - first for _ in range(repeats)]
        p_best, p_med = _rates(len(prefill), prefill_s)
        d_best, d_med = _rates(decode_tokens, decode_s)
        return {"prefill_tok_s_best": p_best, "prefill_tok_s_median": p_med, "decode_tok_s_best": d_best,
                "decode_tok_s_median": d_med, "ttft_warm_s": first, "logits_rel_diff": logits_diff}

    eager = measure(hf)
    static, note = None, "; static+compile not run (--compare hf-eager)"
    if compiled:
        hf.generation_config.cache_implementation = "static"
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        try:
            static, note = measure(hf), ""
        except Exception as e:  # a compile failure must not sink the eager numbers
            note = f"; static+compile failed: {type(e).__name__}: {str(e)[:200]}"
    del hf
    torch.cuda.empty_cache()
    return eager, static, (f"HF transformers {transformers.__version__} (torch {torch.__version__}), bf16, same "
                             f"run; prefill timed as one forward, decode as greedy generate() minus its first "
                             f"token{note}")
