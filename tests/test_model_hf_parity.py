"""Parity of the Flax decoder with HF transformers (PyTorch CPU) on tiny random checkpoints."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rag_jax.inference.generate import generate  # noqa: E402
from rag_jax.model.hf import load_hf, params_equal, save_hf  # noqa: E402

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _hf_model(kind):
    torch.manual_seed({"llama": 0, "mistral": 1, "qwen2": 2, "llama31": 3}[kind])
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, rope_theta=10000.0))
    elif kind == "llama31":
        cfg = transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True,
                                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=32),
                                       rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=None))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    # Random (not zero) biases so the Qwen2 QKV-bias path is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "llama31"])
def converted(request, tmp_path_factory):
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    cfg, model, arch = load_hf(path)
    return request.param, hf, cfg, model, arch, path


def test_logits_match_hf(converted):
    kind, hf, cfg, model, _, _ = converted
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 80))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    pos = jnp.broadcast_to(jnp.arange(80), (2, 80))
    ours = np.asarray(model(jnp.asarray(ids), pos, jnp.ones((2, 80), jnp.int32)).logits)
    assert np.abs(ours - ref).max() <= 1e-4, kind
    if kind == "llama31":
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.tie_embeddings
    if kind == "qwen2":
        assert cfg.qkv_bias


def test_greedy_generation_matches_hf(converted):
    kind, hf, cfg, model, _, _ = converted
    ids = np.random.default_rng(11).integers(3, cfg.vocab_size, (2, 64))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[:, 64:].numpy()
    ours = generate(model, ids, max_new_tokens=32)
    np.testing.assert_array_equal(ours, ref, err_msg=kind)


def test_export_reimport_bit_exact_and_hf_loads_it(converted, tmp_path):
    kind, hf, cfg, model, arch, _ = converted
    out = save_hf(model, tmp_path / "export", arch, max_shard_bytes=60_000)  # forces a sharded checkpoint
    assert (out / "model.safetensors.index.json").exists()
    cfg2, model2, arch2 = load_hf(out)
    assert arch2 == arch and cfg2 == cfg
    assert params_equal(model, model2)
    reloaded = type(hf).from_pretrained(out).eval()
    ids = torch.tensor(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 16)))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_load_errors(converted, tmp_path):
    _, _, cfg, _, _, path = converted
    bad = tmp_path / "bad"
    bad.mkdir()
    conf = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**conf, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM"):
        load_hf(bad)
    (bad / "config.json").write_text(json.dumps(conf))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(bad)
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    (bad / "config.json").write_text(json.dumps({**conf, "intermediate_size": conf["intermediate_size"] * 2}))
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight.*shape \(64, 96\).*\(192, 64\)"):
        load_hf(bad)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path / "nowhere")
