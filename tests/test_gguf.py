"""GGUF import on synthetic files written with ``gguf.GGUFWriter``, against transformers' own GGUF loader."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rag_jax.cli import main as cli_main  # noqa: E402
from rag_jax.inference.chat import chat_prompt  # noqa: E402
from rag_jax.model.gguf import load_gguf  # noqa: E402
from rag_jax.model.hf import load_hf  # noqa: E402
from rag_jax.model.load import load_model  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB, HIDDEN, INTER, LAYERS = 264, 64, 128, 2
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _permute(w, heads):
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute), written from its definition."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tokenizer(w):
    """A byte-level BPE vocabulary: 256 bytes, merges for " the", two ChatML control tokens, padding to VOCAB."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<pad{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(TEMPLATE)


def write_gguf(path, arch, *, heads, kv_heads, types, tied, biases=False, seed=0, extra=None, metadata=None,
               tokenizer=False):
    """A random-weight GGUF of ``arch``; ``types``: GGUF short name (``attn_q``...) -> quantization type."""
    rng = np.random.default_rng(seed)
    d = HIDDEN // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(d)
    w.add_vocab_size(VOCAB)
    for key, value in (metadata or {}).items():
        w.add_key_value(key, *value)
    if tokenizer:
        add_tokenizer(w)

    def add(name, arr, qtype):
        arr = arr.astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, arr.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    add("token_embd.weight", rng.normal(0, 0.5, (VOCAB, HIDDEN)), types.get("token_embd", Q.F32))
    add("output_norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN), Q.F32)
    if not tied:
        add("output.weight", rng.normal(0, 0.2, (VOCAB, HIDDEN)), types.get("output", Q.Q8_0))
    shapes = {"attn_q": (heads * d, HIDDEN), "attn_k": (kv_heads * d, HIDDEN), "attn_v": (kv_heads * d, HIDDEN),
              "attn_output": (HIDDEN, heads * d), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN), Q.F32)
        for short, shape in shapes.items():
            weight = rng.normal(0, 0.15, shape)
            bias = rng.normal(0, 0.3, shape[0]) if biases and short in ("attn_q", "attn_k", "attn_v") else None
            if arch == "llama" and short in ("attn_q", "attn_k"):
                weight = _permute(weight, heads if short == "attn_q" else kv_heads)
            add(f"blk.{i}.{short}.weight", weight, types.get(short, Q.F32))
            if bias is not None:
                add(f"blk.{i}.{short}.bias", bias, Q.F16)
    for name, arr in (extra or {}).items():
        add(name, arr, Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LLAMA_TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_0,
               "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_0, "token_embd": Q.Q8_0, "output": Q.Q4_0}
QWEN_TYPES = {k: Q.F16 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


def _hf_logits(folder, fname, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.numpy()


def _our_logits(model, ids):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return np.asarray(model(jnp.asarray(ids), pos, jnp.ones(ids.shape, jnp.int32)).logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_gguf_matches_transformers(tmp_path, arch):
    if arch == "llama":  # GQA, Q8_0 and Q4_0 tensors, untied output
        path = write_gguf(tmp_path / "m.gguf", "llama", heads=4, kv_heads=2, types=LLAMA_TYPES, tied=False)
    else:  # biases in F16, tied output
        path = write_gguf(tmp_path / "m.gguf", "qwen2", heads=4, kv_heads=1, types=QWEN_TYPES, tied=True,
                          biases=True, seed=1)
    cfg, model, hf_arch = load_gguf(path)
    assert hf_arch == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert cfg.tie_embeddings == (arch == "qwen2") and cfg.qkv_bias == (arch == "qwen2")
    assert (cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps, cfg.max_seq_len) == (
        2 if arch == "llama" else 1, 50000.0, pytest.approx(1e-6), 512)
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, 70))
    ref = _hf_logits(tmp_path, "m.gguf", ids)
    assert np.abs(_our_logits(model, ids) - ref).max() <= 1e-4


def test_gguf_to_hf_folder_round_trip(tmp_path):
    """GGUF -> rag-jax -> save_hf (``rag-jax convert``) -> transformers from_pretrained: identical logits."""
    path = write_gguf(tmp_path / "m.gguf", "llama", heads=4, kv_heads=2, types=LLAMA_TYPES, tied=False, seed=2)
    assert cli_main(["convert", str(path), str(tmp_path / "hf")]) == 0
    _, model, _ = load_gguf(path)
    ids = np.random.default_rng(4).integers(0, VOCAB, (1, 60))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(_our_logits(model, ids) - ref).max() <= 1e-5
    _, back, _ = load_hf(tmp_path / "hf")
    assert np.array_equal(_our_logits(back, ids), _our_logits(model, ids))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_converted_folder_keeps_tokenizer_template_and_eos(tmp_path):
    """``convert`` writes tokenizer.json, tokenizer_config.json (template) and generation_config.json (eos):
    load_model on the folder, and transformers' AutoTokenizer, see what load_model sees in the GGUF file."""
    path = write_gguf(tmp_path / "m.gguf", "llama", heads=4, kv_heads=2, types={}, tied=True, tokenizer=True)
    assert cli_main(["convert", str(path), str(tmp_path / "hf")]) == 0
    g, h = load_model(path), load_model(tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = ["the theme", "<|im_start|>user\nthe 12  34 😀 naïve<|im_end|>\n", "  the\t\tthe  "]
    ids = [g.tokenizer.encode(t).ids for t in texts]
    assert ids == [h.tokenizer.encode(t).ids for t in texts] == [hf_tok.encode(t) for t in texts]
    assert 258 in ids[0]  # the merged " the" token is used
    assert g.eos_ids == h.eos_ids == (260,) and g.chat_template == h.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "the"}]
    assert chat_prompt(g, messages) == chat_prompt(h, messages) == hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize("case, message", [
    ("arch", "general.architecture='gpt2' is not supported"),
    ("yarn", "llama.rope.scaling.type='yarn' is not supported"),
    ("rope_freqs", "'rope_freqs.weight'"),
    ("unknown_tensor", "'blk.0.attn_q_norm.weight'"),
])
def test_gguf_refusals(tmp_path, case, message):
    V = gguf.GGUFValueType
    kwargs = dict(heads=4, kv_heads=2, types={}, tied=True)
    if case == "arch":
        path = write_gguf(tmp_path / "m.gguf", "gpt2", **kwargs)
    elif case == "yarn":
        path = write_gguf(tmp_path / "m.gguf", "llama", **kwargs,
                          metadata={"llama.rope.scaling.type": ("yarn", V.STRING)})
    elif case == "rope_freqs":
        path = write_gguf(tmp_path / "m.gguf", "llama", **kwargs, extra={"rope_freqs.weight": np.ones(8)})
    else:
        path = write_gguf(tmp_path / "m.gguf", "llama", **kwargs, extra={"blk.0.attn_q_norm.weight": np.ones(16)})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_gguf(path)
