"""One folder per paper: its training recipes and its experiments, over the library below.

- ``block_attention``: Block-Attention (Ma et al., ICLR 2025). ``finetune`` (the paper's 1:1 full/block
  fine-tuning of a pretrained chat model), ``distill`` (block mode distilled from the model's own full attention),
  and the evaluations ``block_nq``, ``block_distill``, ``block_quality``. Mechanism: ``model.masks`` (the block
  mask), ``inference.block_attention`` / ``block_prefix`` / ``kv_store`` (passage KV reuse), ``data.block_rag``,
  ``train.objectives.block`` / ``block_distill``.
- ``grit``: GRIT (Muennighoff et al., 2024). ``grit_eval`` (embedding + generation quality of a GRIT-trained
  reader), ``grit_pretrained`` (GRIT on a pretrained chat model). Mechanism: ``model.embedding``,
  ``data.grit``, ``train.objectives.grit``, ``inference.grit_cache``.
- ``em_llm``: EM-LLM (Fountas et al., ICLR 2025). ``passkey`` (a byte reader far past its trained context),
  ``long_context`` (real models: passkey, KV retrieval, haystack; EM-LLM vs InfLLM vs sliding window vs full).
  Mechanism: ``rag_jax.memory``.
- ``needles``: Artificial Needles (Xiong et al., ICLR 2025). ``needles`` (synthetic key-value retrieval
  fine-tuning and its held-out evaluation). Mechanism: ``data.needles``, ``train.finetune`` (``modes="full"``);
  its long-context evaluation is ``em_llm.long_context`` (RULER-style tasks, ``data.ruler``).
- ``rapid``: RAPID (Chen et al., ICML 2025). ``rapid`` (retrieval-augmented speculative decoding on long-context
  prompts: target alone, RAG drafter alone, RAPID per margin). Mechanism: ``inference.rapid``.
- ``rag_demo``: ``rag-jax demo``, the end-to-end RAG job (universe, GRIT + Block-Attention fine-tuning, ScaNN
  retrieval, answers, TTFT).

A recipe imports the library (model, data, inference, retrieval, memory, train, evaluation) and never another
recipe's internals except the shared Block-Attention data helpers; nothing below imports a recipe.
"""
