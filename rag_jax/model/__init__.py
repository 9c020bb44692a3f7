"""Core model: config, RoPE, the mask builder, the attention function, KV segments, the decoder."""
from rag_jax.model.attention import attend, attend_joint, key_mass
from rag_jax.model.config import ModelConfig
from rag_jax.model.kv import KVSegment
from rag_jax.model.masks import MASK_MODES, MaskSpec, build_mask
from rag_jax.model.rope import apply_rope, rope_inv_freq
from rag_jax.model.transformer import ModelOutput, Transformer, check_inputs, count_params, jit_forward

__all__ = ["ModelConfig", "Transformer", "ModelOutput", "KVSegment", "build_mask", "MaskSpec", "MASK_MODES", "attend",
           "attend_joint", "key_mass", "apply_rope", "rope_inv_freq", "check_inputs", "count_params", "jit_forward"]
