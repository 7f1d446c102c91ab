"""Qwen3.5 hybrid models (models/qwen35.py): logits against HF Qwen3_5ForCausalLM on tiny random models,
decode against prefill, CPU against reference (with and without passes), replay, passes, GGUF names."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402
from _model_helpers import redraw_hf_weights  # noqa: E402
from graphir.backends.registry import get_backend  # noqa: E402
from graphir.models import qwen35  # noqa: E402
from graphir.models.gguf_file import GGUFFile  # noqa: E402
from graphir.models.hf_dir import load_hf_dir  # noqa: E402

from graphir.passes import coverage, run_pipeline  # noqa: E402
from graphir.run_inputs import new_state  # noqa: E402
from graphir.weights import Weight, Weights  # noqa: E402

IDS = [3, 17, 250, 99, 0, 299, 42, 42, 7, 128, 64]
# 4 layers: 3 DeltaNet + 1 attention. 2 key heads serve 4 value heads; d_k != d_v catches transposes.
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=128,
            rms_norm_eps=1e-6)


def tiny_hf(tied: bool = False, seed: int = 0):
    """A tiny HF model, weights redrawn at unit-ish scale (HF's 0.02 init and zero norms would hide mistakes)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TINY, tie_word_embeddings=tied))
    redraw_hf_weights(model)  # zero-centred norms (x * (1 + w)) but the DeltaNet's gated norm; HF's decay init
    model.config._attn_implementation = "eager"
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def assert_close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-3, what: str = "") -> None:
    assert ours.shape == ref.shape
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert err <= rel * scale, f"{what} max |diff| {err:.3g} > {rel} * max |value| {scale:.3g}"


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf()


@pytest.fixture(scope="module")
def loaded(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35")
    hf_model.save_pretrained(path)
    hf, raw = load_hf_dir(path)
    config = qwen35.config_from_hf(hf)
    return config, qwen35.weights_from_hf(config, raw)


class Runner:
    """Programs per token count over one state: feed(ids) appends at the current position."""

    def __init__(self, config, weights, backend: str = "cpu", passes: str = ""):
        self.config, self.weights, self.backend, self.passes = config, weights, backend, passes
        self.dtypes = {k: w.dtype for k, w in weights.items()}
        self.programs: dict[int, object] = {}
        self.state = new_state(qwen35.build(config, "decode", dtypes=self.dtypes))
        self.n_past = 0

    def program(self, n: int, fresh: bool = False):
        if fresh or n not in self.programs:
            graph = qwen35.build(self.config, "decode" if n == 1 else "prefill", n, self.dtypes)
            if self.passes:
                graph = run_pipeline(graph, self.passes)
            prog = get_backend(self.backend).lower(graph, self.weights)
            if fresh:
                return prog
            self.programs[n] = prog
        return self.programs[n]

    def feed(self, ids, fresh: bool = False) -> np.ndarray:
        n = len(ids)
        pos = np.arange(self.n_past, self.n_past + n, dtype=np.int32)
        inputs = {"tokens": np.asarray(ids, np.int32), "pos": pos, "kv_idx": pos,
                  "kv_len": np.array([self.n_past + n], np.int32)}
        out = self.program(n, fresh)(inputs, self.state)["logits"]
        self.n_past += n
        return out


# ---------------------------------------------------------------- against transformers
def test_config_from_hf(loaded):
    config, weights = loaded
    assert (config.ssm_k_heads, config.ssm_v_heads, config.ssm_k_dim, config.ssm_v_dim) == (2, 4, 8, 12)
    assert config.n_rot == 4 and config.v_head_order == "grouped"
    assert [qwen35.is_recurrent(config, i) for i in range(4)] == [True, True, True, False]
    assert weights["blk.0.ssm_conv1d.weight"].shape == (config.conv_dim, 4)
    assert (weights["blk.0.ssm_a"].data < 0).all()  # -exp(A_log)


@pytest.mark.parametrize("change, rule", [
    ({"full_attention_interval": 0, "layer_types": ["linear_attention"] * 4}, "full_attention_interval 0 must be >= 1"),
    ({"linear_num_key_heads": 0}, "ssm_k_heads 0 must be >= 1"),
])
def test_zero_counts_in_an_hf_config_are_named(change, rule):
    """These were ZeroDivisionErrors (a modulo by the interval, and by the key head count)."""
    from graphir.errors import GraphirError

    base = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    with pytest.raises(GraphirError, match=rule):
        qwen35.check_config(qwen35.config_from_hf({**base, **change}, "config.json"))


def test_logits_match_transformers_reference_backend(hf_model, loaded):
    ours = Runner(*loaded, backend="reference").feed(IDS)
    assert_close(ours, hf_logits(hf_model, IDS))


def test_logits_match_transformers_cpu_chunked_prefill(hf_model, loaded):
    """70 tokens: the CPU kernel runs the chunked delta rule across a 64-token chunk boundary."""
    ids = list(np.random.default_rng(3).integers(0, 300, 70))
    ours = Runner(*loaded, backend="cpu", passes="default").feed(ids)
    assert_close(ours, hf_logits(hf_model, ids))


def test_tied_embeddings(tmp_path):
    model = tiny_hf(tied=True, seed=1)
    model.save_pretrained(tmp_path)
    hf, raw = load_hf_dir(tmp_path)
    config = qwen35.config_from_hf(hf)
    assert config.tied_embeddings
    weights = qwen35.weights_from_hf(config, raw)
    assert "output.weight" not in weights
    assert_close(Runner(config, weights, backend="reference").feed(IDS), hf_logits(model, IDS))


# ---------------------------------------------------------------- decode, chunks, backends, replay
def test_decode_token_by_token_equals_one_prefill(loaded):
    ids = list(np.random.default_rng(4).integers(0, 300, 20))
    whole = Runner(*loaded, passes="default")
    want = whole.feed(ids)
    step = Runner(*loaded, passes="default")
    got = np.concatenate([step.feed([t]) for t in ids])
    assert_close(got, want, rel=1e-4)
    for name, buf in whole.state.items():  # f32 rounding scales with the state's magnitude, as for logits
        assert_close(step.state[name], buf, rel=1e-4, what=name)


def test_prefill_in_chunks_equals_one_prefill(loaded):
    ids = list(np.random.default_rng(5).integers(0, 300, 30))
    want = Runner(*loaded).feed(ids)
    split = Runner(*loaded)
    got = np.concatenate([split.feed(ids[:17]), split.feed(ids[17:29]), split.feed(ids[29:])])
    assert_close(got, want, rel=1e-4)


@pytest.mark.parametrize("passes", ["", "default"])
def test_cpu_equals_reference(loaded, passes):
    ids = list(np.random.default_rng(6).integers(0, 300, 20))
    ref, cpu = Runner(*loaded, backend="reference"), Runner(*loaded, backend="cpu", passes=passes)
    assert_close(cpu.feed(ids), ref.feed(ids), rel=1e-4)
    for t in (5, 77, 1):  # decode steps after the prefill
        assert_close(cpu.feed([t]), ref.feed([t]), rel=1e-4)
    for name, buf in ref.state.items():
        assert_close(cpu.state[name], buf, rel=1e-4, what=name)  # relative to the state's max, as for logits


def test_replayed_decode_program_equals_fresh_programs_bitwise(loaded):
    """One decode program run at positions 0..N equals a freshly lowered program per position, bit for bit:
    nothing position-dependent is baked into the program, and the state views never move."""
    ids = list(np.random.default_rng(7).integers(0, 300, 9))
    replayed, fresh = Runner(*loaded, passes="default"), Runner(*loaded, passes="default")
    for t in ids:
        np.testing.assert_array_equal(replayed.feed([t]), fresh.feed([t], fresh=True))
    assert len(replayed.programs) == 1
    for name, buf in replayed.state.items():
        np.testing.assert_array_equal(fresh.state[name], buf, err_msg=name)


def test_reset_recurrent_zeroes_only_recurrent_state(loaded):
    r = Runner(*loaded)
    r.feed(IDS[:3])
    qwen35.reset_recurrent(r.config, r.state)
    assert not r.state["blk.0.conv_state"].any() and not r.state["blk.2.ssm_state"].any()
    assert r.state["blk.3.k_cache"].any()


# ---------------------------------------------------------------- passes
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_passes_fire_on_the_model_graph(loaded, phase):
    config, weights = loaded
    report = coverage(qwen35.build(config, phase, None if phase == "decode" else 20))
    for name, sites in [("fuse-ssm-conv-silu", 3), ("fuse-gated-delta-net-raw", 3), ("fuse-gated-delta-net-l2", 3),
                        ("fuse-rms-norm-mul-gate", 3), ("fuse-mul-sigmoid", 1)]:
        assert len(report[name].matched) == sites, report.text()
        assert not report[name].rejected, report.text()
    if phase == "prefill":  # 20 rows: compute-bound projections stay apart (no strided views to copy)
        assert not report["stack-projections"].matched
        assert all("max_rows" in why for _, why in report["stack-projections"].rejected), report.text()
        return
    assert len(report["stack-projections"].matched) == 8 and not report["stack-projections"].rejected
    stacked = " ".join(report["stack-projections"].matched)
    for part in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "attn_q", "attn_k", "attn_v"):
        assert f"blk.0.{part}" in stacked or f"blk.3.{part}" in stacked


def test_gated_attention_fuses_in_verify_graphs(loaded):
    """A speculative verify call (several rows): the gate product fuses, and q and gate become views of
    the stacked projection (fold-reshape-view), so the gpu gathers neither."""
    config, _ = loaded
    graph = qwen35.build(config, "verify", 5)
    report = coverage(graph)
    assert len(report["fuse-mul-sigmoid"].matched) == 1 and not report["fuse-mul-sigmoid"].rejected, report.text()
    out = run_pipeline(graph, "default")
    gates = [n for n in out.nodes() if n.op == "mul_sigmoid"]
    assert len(gates) == 1 and gates[0].src[1].op == "view" and gates[0].src[1].src[0].op == "mul_mat"


def test_default_passes_keep_decode_logits(loaded):
    """Decode through the default pipeline (stacked projections, strided q/gate views, mul_sigmoid) on the
    cpu gives the unfused reference's logits, token after token."""
    fused, plain = Runner(*loaded, backend="cpu", passes="default"), Runner(*loaded, backend="reference")
    for ids in (IDS[:4], IDS[4:5], IDS[5:6]):
        assert_close(fused.feed(ids), plain.feed(ids), 1e-4, "default passes on the cpu")


# ---------------------------------------------------------------- GGUF (llama.cpp qwen35 names)
def _tiled(x: np.ndarray, axis: int, hk: int, per_head: int) -> np.ndarray:
    """llama.cpp's converter order: value heads grouped by key head [k0v0, k0v1, k1v0, k1v1] -> tiled
    [k0v0, k1v0, k0v1, k1v1], along `axis` (of size v_heads * per_head)."""
    y = np.moveaxis(x, axis, 0)  # [v_heads * per_head, ...]
    rest = y.shape[1:]
    y = y.reshape(hk, -1, per_head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(y, 0, axis))


def write_qwen35_gguf(path, config, weights: Weights) -> None:
    """What convert_hf_to_gguf.py writes for Qwen3.5: our (already converted) tensors with v heads tiled,
    plus one MTP block after the trunk (which graphir ignores)."""
    c = config
    hk, hv, dk, dv = c.ssm_k_heads, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim
    w = gguf.GGUFWriter(str(path), "qwen35")
    a = "qwen35."
    for key, value in [("block_count", c.n_layers + 1), ("nextn_predict_layers", 1),
                       ("context_length", c.context_length),
                       ("embedding_length", c.d_model), ("feed_forward_length", c.d_ff),
                       ("attention.head_count", c.n_heads), ("attention.head_count_kv", c.n_kv_heads),
                       ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim),
                       ("rope.dimension_count", c.n_rot), ("ssm.conv_kernel", c.ssm_conv_kernel),
                       ("ssm.state_size", dk), ("ssm.group_count", hk), ("ssm.time_step_rank", hv),
                       ("ssm.inner_size", hv * dv), ("full_attention_interval", c.full_attn_interval)]:
        w.add_uint32(a + key, value)
    w.add_float32(a + "rope.freq_base", c.rope_theta)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", c.rms_eps)
    qk = 2 * hk * dk
    for name, wt in weights.items():
        x = np.array(wt.data, np.float32)
        rest = name.split(".", 2)[-1]
        if rest == "attn_qkv.weight":
            x = np.concatenate([x[:qk], _tiled(x[qk:], 0, hk, dv)])
        elif rest == "ssm_conv1d.weight":
            x = np.concatenate([x[:qk], _tiled(x[qk:], 0, hk, dv)])
        elif rest == "attn_gate.weight":
            x = _tiled(x, 0, hk, dv)
        elif rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            x = _tiled(x, 0, hk, 1)
        elif rest == "ssm_out.weight":
            x = _tiled(x, 1, hk, dv)
        w.add_tensor(name, x)
    w.add_tensor(f"blk.{c.n_layers}.nextn.eh_proj.weight", np.zeros((c.d_model, 2 * c.d_model), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_names_and_tiled_value_heads_match_transformers(hf_model, loaded, tmp_path):
    config, weights = loaded
    path = tmp_path / "tiny-qwen35.gguf"
    write_qwen35_gguf(path, config, weights)
    f = GGUFFile(path)
    gconfig = qwen35.config_from_gguf(f.metadata, f.tensors, f.label)
    assert gconfig.v_head_order == "tiled" and gconfig.ssm_v_dim == config.ssm_v_dim
    assert gconfig.n_layers == config.n_layers  # the MTP block is not part of the trunk
    gweights = qwen35.weights_from_gguf(gconfig, f.weights())
    assert_close(Runner(gconfig, gweights, backend="reference").feed(IDS), hf_logits(hf_model, IDS))
    assert_close(Runner(gconfig, gweights, backend="cpu", passes="default").feed(IDS), hf_logits(hf_model, IDS))


def test_gguf_per_layer_head_counts_are_the_attention_layers(hf_model, loaded, tmp_path):
    """Hybrid GGUFs may store the head counts per layer, 0 on the DeltaNet layers: the config takes the
    attention layers' counts, as from the scalar keys."""
    config, weights = loaded
    path = tmp_path / "tiny-qwen35.gguf"
    write_qwen35_gguf(path, config, weights)
    f = GGUFFile(path)
    attends = [t == "full_attention" for t in hf_model.config.layer_types] + [True]  # + the MTP block
    assert not attends[0] and any(attends[:-1])
    md = dict(f.metadata)
    for key in ("qwen35.attention.head_count", "qwen35.attention.head_count_kv"):
        md[key] = [int(md[key]) if a else 0 for a in attends]
    got = qwen35.config_from_gguf(md, f.tensors, f.label)
    assert got == qwen35.config_from_gguf(f.metadata, f.tensors, f.label)
    assert (got.n_heads, got.n_kv_heads) == (hf_model.config.num_attention_heads, hf_model.config.num_key_value_heads)


def test_hf_names_of_the_multimodal_checkpoint():
    assert qwen35.hf_to_param_name("model.language_model.layers.2.linear_attn.in_proj_qkv.weight") == \
        "blk.2.attn_qkv.weight"
    assert qwen35.hf_to_param_name("model.language_model.embed_tokens.weight") == "token_embd.weight"
    assert qwen35.hf_to_param_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert qwen35.HF_SKIPPED.search("mtp.layers.0.mlp.up_proj.weight")


# ---------------------------------------------------------------- presets
def test_random_tiny_preset_runs():
    config, dtype = qwen35.PRESETS["qwen35-tiny"]
    weights = qwen35.random_weights(config, dtype)
    qwen35.check_weights(config, weights)
    r = Runner(config, weights, passes="default")
    logits = np.concatenate([r.feed(list(range(40, 60))), r.feed([7])])
    assert logits.shape == (21, config.n_vocab) and np.isfinite(logits).all()


def test_real_size_preset_shapes():
    config, dtype = qwen35.PRESETS["qwen35-0.8b"]
    n = sum(int(np.prod(s)) for s in qwen35.param_shapes(config).values())
    assert 0.70e9 < n < 0.80e9  # Qwen3.5-0.8B's text weights (tied), without the vision tower and MTP head
    graph = qwen35.build(config, "decode", dtypes={k: dtype for k in qwen35.param_shapes(config)})
    assert sum(s.op == "state" for s in graph.nodes()) == 18 * 2 + 6 * 2


def test_weight_check_names_the_hf_tensor(loaded):
    config, weights = loaded
    broken = Weights({k: w for k, w in weights.items() if k != "blk.1.ssm_a"}, source="x")
    with pytest.raises(Exception, match="linear_attn.A_log"):
        qwen35.check_weights(config, broken, hf_names=True)
    extra = Weights({**dict(weights.items()), "blk.9.ssm_a": Weight("f32", (4,), np.zeros(4, np.float32))})
    with pytest.raises(Exception, match="not used"):
        qwen35.check_weights(config, extra)


def test_config_and_tensors_to_hf_rebuild_the_model():
    """config_to_hf and tensor_to_hf (what `graphir bench --compare hf` builds HF's model from): an HF
    Qwen3_5ForCausalLM made from the random preset's config and our tensors gives our logits."""
    from graphir.models.qwen35 import FAMILY

    from graphir.api import load

    ours = load("random:qwen35-tiny", backend="reference", passes="")
    cfg = dict(FAMILY.config_to_hf(ours.config))
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    state = {}
    for name, w in ours.weights.items():
        a = FAMILY.tensor_to_hf(name, np.asarray(w.data, np.float32).reshape(w.shape))
        state[FAMILY.hf_names.to_file(name)] = torch.from_numpy(np.ascontiguousarray(a))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    hf.config._attn_implementation = "eager"
    ids = [3, 17, 250, 99, 0, 271, 42, 42, 7, 128, 64]  # within the preset's 272 tokens
    assert_close(ours.logits(ids), hf_logits(hf.eval(), ids), 1e-3, "HF model from config_to_hf")
