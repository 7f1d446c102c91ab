"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM, GGUF `qwen2`): llama's graph with biases on the q, k and v projections.

Against HF transformers: tiny models of awkward sizes (q_dim 120 != hidden 72, 3 query heads a KV head, 1031 ids)
saved to a temp dir with every weight redrawn, the biases too (HF initialises them to zero, so a dropped bias would
pass): an 11-token prefill, 4 decode steps and a 3-token call (a speculative verify's size, where stack-projections
stacks the biases) on each backend, f32 and bf16 files, the same tensors as a GGUF, and config_to_hf (`graphir bench
--compare hf`). REL is of the largest |logit| against transformers in f64, as tests/test_hf_awkward_sizes.py
measures (measured 2026-12-04, HF directory and GGUF alike: reference 5.3e-7, cpu 3.9e-7).

The passes on the real Qwen2.5-0.5B graph (24 layers): every layer's q|k|v product and its three biases stacked in
each pipeline, only ops the gpu backend lowers, and the passed graph's values equal the unpassed graph's on the
reference backend (at 0.5B's widths, two layers and a small vocabulary: the reference backend is numpy).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter

import numpy as np
import pytest
from _gpu_helpers import gpu_only, host
from _model_helpers import redraw_hf_weights, write_gguf
from graphir.models.presets import PRESETS, ByteTokenizer
from graphir.models.registry import family_of

import graphir
from graphir.api import Model
from graphir.errors import LoadError
from graphir.passes import coverage, run_pipeline

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

REL = 1e-5  # 10x the measured error (module doc); a dropped or doubled bias moves the logits by 1e-1 of their scale
VOCAB = 1031
IDS = [int(t) for t in np.random.default_rng(11).integers(1, VOCAB, 18)]
PREFILL, STEPS = 11, 4  # then one 3-token call: 18 positions
BACKENDS = ["reference", "cpu", pytest.param("gpu", marks=[pytest.mark.gpu, gpu_only])]
REAL, _ = PRESETS["qwen2.5-0.5b"]


def tiny_qwen2(tied: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=200, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=40, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=tied))
    redraw_hf_weights(model)  # biases too: HF's are zero, so a dropped one would pass
    model.config._attn_implementation = "eager"
    return model.eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():  # in f64 (the model is left in f64), so that only graphir's f32 rounding is measured
        return model.double()(torch.tensor([ids])).logits[0].numpy()


def our_logits(model, ids: list[int] = IDS) -> np.ndarray:
    """A prefill of PREFILL tokens, STEPS decode steps, then the rest in one call: a row per position."""
    rows = [host(model.logits(ids[:PREFILL]))]
    rows += [host(model.feed([t])).reshape(1, -1) for t in ids[PREFILL:PREFILL + STEPS]]
    rows.append(host(model.feed(ids[PREFILL + STEPS:])).reshape(len(ids) - PREFILL - STEPS, -1))
    return np.concatenate(rows)


def assert_close(got: np.ndarray, want: np.ndarray, what: str, rel: float = REL) -> None:
    assert got.shape == want.shape, what
    scale = float(np.abs(want).max())
    for i in range(len(want)):
        err = float(np.abs(got[i] - want[i]).max()) / scale
        assert err <= rel, f"{what}: position {i}: max |diff| {err:.3g} of max |logit|"


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved(request, tmp_path_factory):
    """(directory, HF model, transformers' f64 logits of IDS)."""
    model = tiny_qwen2(tied=request.param)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return path, model, hf_logits(model, IDS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_directory_matches_transformers(saved, backend):
    path, hf, want = saved
    model = graphir.load(str(path), backend=backend)  # the backend's own pipeline
    c = model.config
    assert (c.arch, c.qkv_bias, c.qk_norm, c.rope_mode, c.rope_theta) == ("qwen2", True, False, "neox", 1e6)
    assert c.tied_embeddings == hf.config.tie_word_embeddings and model.weights["blk.2.attn_v.bias"].shape == (40,)
    assert_close(our_logits(model), want, f"qwen2 on {backend} ({model.passes})")


def test_bf16_file_keeps_its_dtype(tmp_path):
    model = tiny_qwen2(tied=False, seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ours = graphir.load(str(tmp_path), backend="reference")
    assert {ours.weights[n].dtype for n in ("blk.0.attn_q.weight", "blk.0.attn_k.bias")} == {"bf16"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    assert_close(our_logits(ours), hf_logits(hf.eval(), IDS), "bf16 file")


def hf_state(hf) -> dict:
    """The checkpoint's tensors as save_pretrained writes them (a tied head is not written)."""
    tied = hf.config.tie_word_embeddings
    return {k: v.float().clone() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}


def gguf_tensors(hf, names) -> dict[str, np.ndarray]:
    """HF's tensors under our (GGUF) names, as llama.cpp's converter writes a qwen2 file: no row permutation
    (NEOX rope), f32 biases, no output.weight when tied."""
    out = {}
    for hf_name, p in hf.state_dict().items():
        name = names.to_ours(hf_name)
        if name is not None and not (name == "output.weight" and hf.config.tie_word_embeddings):
            out[name] = p.float().numpy()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_gguf_matches_transformers(saved, tmp_path, backend):
    path, hf, want = saved
    c = graphir.load(str(path), backend="reference").config
    file = write_gguf(tmp_path / "qwen2.gguf", c, gguf_tensors(hf, family_of(c).hf_names))
    model = graphir.load(str(file), backend=backend)
    got = model.config  # the file's eps is an f32
    assert got == dataclasses.replace(c, ctx=got.ctx, rms_eps=got.rms_eps) and got.rms_eps == pytest.approx(1e-6)
    assert model.weights["blk.0.attn_q.bias"].dtype == "f32"
    assert_close(our_logits(model), want, f"qwen2 GGUF on {backend}")


def test_a_bias_of_the_wrong_length_names_the_file_and_tensor(saved, tmp_path):
    path, hf, _ = saved
    state = hf_state(hf)
    state["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(41)
    bad = tmp_path / "hf"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    safetensors_torch.save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(LoadError, match=rf"{bad}: tensor 'blk\.1\.attn_k\.bias' \(file name "
                                        r"'model\.layers\.1\.self_attn\.k_proj\.bias'\) has shape \[41\], "
                                        r"the qwen2 config expects \[40\]"):
        graphir.load(str(bad))
    c = graphir.load(str(path), backend="reference").config
    tensors = gguf_tensors(hf, family_of(c).hf_names)
    tensors["blk.2.attn_q.bias"] = np.ones(119, np.float32)
    file = write_gguf(tmp_path / "bad.gguf", c, tensors)
    with pytest.raises(LoadError, match=r"bad\.gguf: tensor 'blk\.2\.attn_q\.bias' has shape \[119\], "
                                        r"the qwen2 config expects \[120\]"):
        graphir.load(str(file))


def test_a_missing_bias_is_refused(saved, tmp_path):
    """A Qwen2 file without its v bias is refused, not run as llama; llama's attention_bias stays refused."""
    path, hf, _ = saved
    state = hf_state(hf)
    del state["model.layers.0.self_attn.v_proj.bias"]
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"missing tensor 'blk\.0\.attn_v\.bias' \(file name "
                                        r"'model\.layers\.0\.self_attn\.v_proj\.bias'\)"):
        graphir.load(str(tmp_path))
    cfg["layer_types"][1] = "sliding_attention"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"layer_types \['sliding_attention'\] are not supported"):
        graphir.load(str(tmp_path))


def test_config_to_hf_rebuilds_the_model():
    """What `graphir bench --compare hf` builds: an HF Qwen2ForCausalLM from config_to_hf and our tensors (HF names)
    gives our logits, biases included."""
    ours = graphir.load("random:qwen2-tiny", backend="reference", passes="")
    family = family_of(ours.config)
    cfg = dict(family.config_to_hf(ours.config))
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    state = {family.hf_names.to_file(n): torch.from_numpy(np.array(w.data, np.float32))
             for n, w in ours.weights.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    hf.config._attn_implementation = "eager"
    ids = [3, 17, 250, 99, 0, 271, 42, 42, 7, 128, 64, 5, 6, 7, 8, 9, 10, 11]  # within the preset's 272 ids
    assert_close(our_logits(ours, ids), hf_logits(hf.eval(), ids), "HF model from config_to_hf", 1e-5)


def test_the_real_preset_is_what_qwen25_05bs_config_reads_as():
    """Qwen/Qwen2.5-0.5B's config.json (as published, transformers 4.43) loads as the qwen2.5-0.5b preset's config:
    its sliding_window is unused (use_sliding_window false), max_window_layers ignored."""
    hf = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
          "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
          "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
          "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
          "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    assert family_of(REAL).config_from_hf(hf, "config.json") == REAL


def test_yarn_added_beside_rope_parameters_is_refused(tmp_path):
    """Qwen2.5's model cards say to add a YaRN `rope_scaling` block to config.json for long texts. In a config.json
    that transformers 5 saved (rope_parameters, default rope) transformers applies that block; graphir read only
    rope_parameters and ran plain rope without a word."""
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=72, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=40,
                                   architectures=["Qwen2ForCausalLM"])
    cfg.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["rope_parameters"]["rope_type"] == "default"
    hf["rope_scaling"] = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}  # the card's
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_type"] == "yarn"  # what HF runs
    with pytest.raises(LoadError, match=r"config\.json: rope scaling 'yarn' is not supported"):
        family_of(REAL).config_from_hf(hf, "config.json")


# ---------------------------------------------------------------- the passes on the real graph
def real_graph(phase: str, n_tokens: int | None = None, **changes):
    c = dataclasses.replace(REAL, ctx=64, **changes)
    return family_of(c).build(c, phase, n_tokens)


def _stacked_qkv(n) -> bool:
    """mul_mat over one layer's q|k|v weights stacked (stack-projections names the stack w1+w2+w3)."""
    parts = n.src[0].name.split("+") if n.op == "mul_mat" and n.src[0].name else []
    return [p.split(".", 2)[-1] for p in parts] == ["attn_q.weight", "attn_k.weight", "attn_v.weight"]


@pytest.mark.parametrize("pipeline", ["default", "cpu", "gpu", "default,kv-f16"])
@pytest.mark.parametrize("n_tokens", [1, 3])  # a decode step, a speculative verify call
def test_real_graph_stacks_qkv_and_biases_in_every_layer(pipeline, n_tokens):
    graph = real_graph("decode" if n_tokens == 1 else "prefill", n_tokens)
    out = run_pipeline(graph, pipeline, verify_each=True)
    ops = Counter(n.op for n in out.nodes())
    layers = REAL.n_layers
    stacked = [n for n in out.nodes() if _stacked_qkv(n)]
    bias_adds = [n for n in out.nodes() if n.op == "add" and any(n.src[0] is m for m in stacked)]
    assert len(stacked) == len(bias_adds) == layers, ops
    assert all(a.src[1].op == "concat" and a.src[1].shape == (1152,) for a in bias_adds)  # 896 + 128 + 128
    assert not [n for n in out.nodes() if n.op == "add" and n.src[1].op == "param"]  # no bias added on its own
    # q roped from its view, K roped into the cache, V written from its view, gate|up with its activation
    assert (ops["rope"], ops["rope_set_rows"], ops["set_rows"], ops["mul_mat_swiglu"]) == (layers,) * 4
    assert ops["mul_mat"] == 3 * layers + 1  # q|k|v, attn_output, ffn_down a layer, and the head
    report = coverage(graph, pipeline)["stack-projections"]
    assert sum("with their biases" in m for m in report.matched) == layers, report.matched


@pytest.mark.parametrize("phase, n_tokens", [("decode", 1), ("prefill", 3), ("prefill", 40)])
def test_gpu_pipeline_leaves_only_ops_the_gpu_backend_lowers(phase, n_tokens):
    from graphir.backends.gpu.lowering import has_rule

    out = run_pipeline(real_graph(phase, n_tokens), "gpu")
    ops = {n.op for n in out.nodes() if not n.is_leaf}
    assert ops and all(has_rule(op) for op in ops), sorted(op for op in ops if not has_rule(op))
    if n_tokens > 16:  # prefill: projections unstacked (compute-bound), each bias added to its bf16 product
        assert sum(n.op == "add" and n.src[1].op == "param" for n in out.nodes()) == 3 * REAL.n_layers


@pytest.mark.parametrize("pipeline", ["default", "cpu", "gpu"])
def test_passed_real_graph_equals_unpassed_on_the_reference(pipeline):
    """Qwen2.5-0.5B's widths (896, 14 heads over 2 KV heads of 64, 4864) with 2 layers and 300 ids: the passed
    model's prefill, decode steps and 3-token call equal the unpassed model's."""
    c = dataclasses.replace(REAL, n_layers=2, n_vocab=300, ctx=64)
    weights = family_of(c).random_weights(c, "f32", 0)
    plain = Model(c, weights, ByteTokenizer(c.n_vocab), backend="reference", passes="")
    passed = Model(c, weights, ByteTokenizer(c.n_vocab), backend="reference", passes=pipeline)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 300, 18)]
    assert_close(our_logits(passed, ids), our_logits(plain, ids), f"{pipeline} vs no passes", 1e-5)


@pytest.mark.gpu
@gpu_only
def test_gpu_runs_the_real_preset_as_the_reference_does():
    """random:qwen2.5-0.5b (24 layers, bf16 weights) on the gpu's own pipeline against the reference backend running
    the same pipeline and prompt chunks: an 11-token prefill, 4 decode steps (stacked q|k|v and biases) and a 25-token
    call (bf16 GEMMs, biases added to each product). The bound is test_model_matrix.py's for the `auto` pipelines."""
    gpu = graphir.load("random:qwen2.5-0.5b", backend="gpu", ctx=128)
    ref = graphir.load("random:qwen2.5-0.5b", backend="reference", passes=gpu.passes, ctx=128)
    ref.prefill_buckets, ref.call_cost = gpu.prefill_buckets, gpu.call_cost
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 256, 40)]
    assert_close(our_logits(gpu, ids), our_logits(ref, ids), f"gpu ({gpu.passes}) vs reference", 1e-2)


def test_tensor_parallel_splits_each_bias_with_its_rows():
    """shard-tp: a q/k/v bias is sliced by the rows its rank's weight keeps (its heads), and the sharded graph
    computes the unsharded logits."""
    from test_shard_tp import assert_same_math, shard

    model = graphir.load("random:qwen2-tiny", backend="reference", passes="")
    sharded = shard(model.graph("decode"), 2)
    names = {p.name for p in sharded.params}
    assert {"blk.0.attn_q.bias@0[0:48]", "blk.0.attn_q.bias@0[48:96]", "blk.0.attn_k.bias@0[0:16]",
            "blk.0.attn_v.bias@0[16:32]"} <= names, sorted(n for n in names if "bias" in n)
    assert_same_math(model, model.graph("decode"), 2, "reference")


def test_cli_runs_dumps_and_checks_the_preset():
    """`graphir run` generates what the API does; `graphir dump --phase verify --passes default` shows the stacked
    bias; `graphir check` holds the gpu pipeline's passes to the reference on the decode graph."""
    from click.testing import CliRunner

    from graphir.cli import main

    def invoke(*args: str):
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    r = invoke("run", "random:qwen2-tiny", "--backend", "reference", "-p", "hello", "-n", "6")
    assert r.exit_code == 0, r.output
    model = graphir.load("random:qwen2-tiny", backend="reference")
    ids = model.tokenizer.encode("hello")
    assert r.stdout.strip() == ("hello" + model.tokenizer.decode(list(model.generate(ids, 6)))).strip()
    r = invoke("dump", "random:qwen2-tiny", "--phase", "verify", "--passes", "default", "--layers", "0")
    assert r.exit_code == 0, r.output
    assert '"blk.0.attn_q.bias+blk.0.attn_k.bias+blk.0.attn_v.bias"' in r.stdout
    r = invoke("check", "random:qwen2-tiny", "-p", "gpu", "--phase", "decode")
    assert r.exit_code == 0, r.output
    assert "stack-projections: 6 matched" in r.stdout and r.stdout.splitlines()[-1].startswith("ok: pipeline 'gpu'")
