"""The HF importer implements a config field or tensor, or refuses it by name; eos id lists in generation."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rag_jax.inference.generate import generate  # noqa: E402
from rag_jax.memory import EMLLM, EMLLMConfig  # noqa: E402
from rag_jax.model import ModelConfig, Transformer  # noqa: E402
from rag_jax.model.hf import load_hf, save_hf  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def _randomize_biases(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def _logits(model, ids):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return np.asarray(model(jnp.asarray(ids), pos, jnp.ones(ids.shape, jnp.int32)).logits)


def _ref(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.numpy()


def test_llama_attention_and_mlp_bias_match_transformers(tmp_path):
    torch.manual_seed(0)
    hf = _randomize_biases(transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)), 0)
    hf.save_pretrained(tmp_path / "in")
    cfg, model, arch = load_hf(tmp_path / "in")
    assert cfg.qkv_bias and cfg.out_bias and cfg.mlp_bias
    ids = np.random.default_rng(0).integers(0, 256, (2, 40))
    assert np.abs(_logits(model, ids) - _ref(hf, ids)).max() <= 1e-4
    save_hf(model, tmp_path / "out", arch)  # and back: transformers reads the same math
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert np.abs(_ref(back, ids) - _ref(hf, ids)).max() <= 1e-6


def test_qwen2_per_layer_sliding_windows_match_transformers(tmp_path):
    """use_sliding_window + max_window_layers=1: transformers windows layers 1 and 2 only (layer_types)."""
    torch.manual_seed(1)
    hf_cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    hf = _randomize_biases(transformers.Qwen2ForCausalLM(hf_cfg), 1)
    hf.save_pretrained(tmp_path / "in")
    cfg, model, arch = load_hf(tmp_path / "in")
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    ids = np.random.default_rng(1).integers(0, 256, (1, 48))
    ref = _ref(hf, ids)
    assert np.abs(_logits(model, ids) - ref).max() <= 1e-4
    everywhere = nnx.merge(nnx.graphdef(Transformer(cfg.replace(layer_types=None), rngs=nnx.Rngs(0))),
                           nnx.state(model))
    assert np.abs(_logits(everywhere, ids) - ref).max() > 1e-3  # a window on every layer is different math
    save_hf(model, tmp_path / "out", arch)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert np.abs(_ref(back, ids) - ref).max() <= 1e-6


def _checkpoint(tmp_path, **config_changes):
    torch.manual_seed(2)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    hf.save_pretrained(tmp_path)
    if config_changes:
        cfg = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not implemented"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0)), "rope_type='yarn' is not"),
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)), "rope_type='dynamic' is not"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5 is not implemented"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not implemented"),
    (dict(pretraining_tp=2), "pretraining_tp=2 is not implemented"),
])
def test_unimplemented_config_fields_are_refused(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_hf(_checkpoint(tmp_path, **changes))


def test_unused_tensor_is_refused(tmp_path):
    path = _checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)  # attention_bias is False
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use, e.g. \['model.layers.0.self_attn.o_proj.bias'\]"):
        load_hf(path)


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path):
    path = _checkpoint(tmp_path, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'lm_head.weight'"):
        load_hf(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # an identical copy is the tie itself
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert load_hf(path)[0].tie_embeddings


def test_duplicate_tensor_across_files_without_index_is_refused(tmp_path):
    path = _checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"] * 2}, path / "extra.safetensors")
    with pytest.raises(ValueError, match="'model.norm.weight' is in both extra.safetensors and model.safetensors"):
        load_hf(path)


def _first_new_token_at(seq, k):
    """The first index >= k whose token did not occur before it."""
    return next(i for i in range(k, len(seq)) if seq[i] not in seq[:i])


def test_eos_list_stops_at_first_listed_id_in_generate():
    model = Transformer(ModelConfig.tiny(vocab_size=64), rngs=nnx.Rngs(3))
    prompt = [[5, 9, 17, 33, 2]]
    free = generate(model, prompt, max_new_tokens=16)[0].tolist()
    i = _first_new_token_at(free, 2)
    absent = next(t for t in range(64) if t not in free)
    out = generate(model, prompt, max_new_tokens=16, eos_id=[absent, free[i]])[0].tolist()
    assert out[:i + 1] == free[:i + 1] and out[i + 1:] == [absent] * (15 - i)
    assert generate(model, prompt, max_new_tokens=16, eos_id=(free[i],))[0].tolist()[:i + 1] == free[:i + 1]
    with pytest.raises(TypeError, match="eos_id"):
        generate(model, prompt, max_new_tokens=4, eos_id=[1.5])


def test_eos_list_stops_at_first_listed_id_in_emllm():
    model = Transformer(ModelConfig.tiny(vocab_size=64), rngs=nnx.Rngs(4))
    em = EMLLM(model, EMLLMConfig(n_init=8, n_local=64, n_mem=48, chunk_size=32, min_block_size=4, max_block_size=16))
    prompt = np.arange(40) % 60
    free = em.generate(prompt, max_new_tokens=12)
    i = _first_new_token_at(free, 1)
    em.reset()
    assert em.generate(prompt, max_new_tokens=12, eos_id=[63 if 63 not in free else 62, free[i]]) == free[:i + 1]
