"""EM-LLM episodic memory (Fountas et al., ICLR 2025): surprise segmentation, graph boundary refinement, event
store with two-stage retrieval, and streaming inference over any rag_jax decoder."""
from rag_jax.memory.config import EMLLMConfig
from rag_jax.memory.event_retrieval import ContiguityBuffer, merge_temporal, retrieval_budget, select_by_similarity
from rag_jax.memory.event_store import DeviceEventCache, EventStore, representative_vectors
from rag_jax.memory.index import EventIndex
from rag_jax.memory.refinement import (conductance_scores, key_similarity, modularity_scores, refine_boundaries,
                                       split_scores)
from rag_jax.memory.segmentation import (boundary_flags, form_events, surprise_from_logits, surprise_threshold,
                                         threshold_window, uniform_flags)
from rag_jax.memory.streaming import EMLLM, LayerBuffers

__all__ = ["EMLLMConfig", "EMLLM", "LayerBuffers", "EventStore", "EventIndex", "DeviceEventCache",
           "representative_vectors", "ContiguityBuffer", "merge_temporal", "retrieval_budget", "select_by_similarity",
           "key_similarity", "modularity_scores", "conductance_scores", "split_scores", "refine_boundaries",
           "surprise_from_logits", "threshold_window", "surprise_threshold", "boundary_flags", "uniform_flags",
           "form_events"]
