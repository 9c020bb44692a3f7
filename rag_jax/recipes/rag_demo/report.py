"""The ``rag-jax demo`` report: the output folder check, the printed summary and the loss / TTFT plots."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rag_jax.atomic import write_text
from rag_jax.data.phantom_rag import answer_text
from rag_jax.evaluation.plots import line_plot
from rag_jax.evaluation.tables import table


def plots(history: list[dict], ttft: list[dict], out: Path) -> dict[str, str]:
    """``loss.png`` (training curves) and ``ttft.png`` (full vs cached prefill) in ``out``; ``{name: path}``."""
    files = {}
    if history:             # the real-model track (``rag_jax.recipes.rag_demo.real_model``) trains nothing
        steps = [h["step"] for h in history]
        losses = (("loss", "total (L_Rep + λ·L_Gen)"), ("loss_rep", "GRIT L_Rep (contrastive)"),
                  ("loss_full", "Block-Attention loss, full pass"), ("loss_block", "Block-Attention loss, block pass"))
        files["loss_plot"] = line_plot(out / "loss.png", [(steps, [h[k] for h in history], label)
                                                          for k, label in losses],
                                       xlabel="step", ylabel="loss (nats)", title="rag-jax demo: training loss")
    if ttft:
        x = [r["prompt_tokens"] for r in ttft]
        files["ttft_plot"] = line_plot(
            out / "ttft.png", [(x, [r["full_ms"] for r in ttft], "full prefill"),
                               (x, [r["cached_ms"] for r in ttft], "Block-Attention, cached passages")],
            xlabel="prompt length (tokens)", ylabel="time to first token (ms, median)", title="TTFT vs prompt length",
            style="o-", size=(6, 4))
    return files


CONDITION_LABELS = {
    "no_retrieval": "no retrieval (question only)",
    "retrieval_full": "retrieved top-{k}, full attention",
    "retrieval_block": "retrieved top-{k}, Block-Attention (KV reuse)",
    "oracle_full": "gold passage(s) in top-{k}, full attention",
    "oracle_block": "gold passage(s) in top-{k}, Block-Attention",
}
# Extra answer columns of the real-model track (its replies are sentences; it reports ``answer_recall``).
EXTRA_SCORES = (("subspan_em", "subspan-EM"), ("answer_recall", "answer recall"))


def format_report(report: dict) -> str:
    """The human-readable report printed at the end of a run."""
    d, tr, qa = report["data"], report["train"], report["qa"]
    k = qa["num_passages"]
    ks = report["config"]["retrieval"]["ks"]
    m = report["model"]
    origin = (f"pretrained {m['name']}, zero-shot" if m.get("name") else
              f"fine-tuned from base {m['base']}" if m.get("base") else "from scratch")
    lines = ["", "=" * 78, "rag-jax demo report", "=" * 78,
             f"data: {d['source']}",
             f"task: {d['question_kind']} questions; {d['train_questions']} train / {d['eval_questions']} held-out; "
             f"articles cut into section passages: {d['train_passages']} train / {d['eval_passages']} held-out",
             f"model: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['params'] / 1e6:.2f}M params, "
             f"vocab {m['vocab_size']}; {origin}",
             (f"training: {tr['steps']} steps in {tr['seconds']:.0f} s (+{tr['compile_seconds']:.0f} s compile); "
              f"final loss {tr['final']['loss']:.3f}, GRIT in-batch top-1 {tr['final']['rep_accuracy']:.2f}, "
              f"next-token accuracy (loss-weighted) {tr['final']['gen_accuracy']:.2f}") if tr else "training: none",
             ""]
    rows = [[r["retriever"], *[r[f"recall@{c}"] for c in ks], *[r[f"hit@{c}"] for c in ks]]
            for r in report["retrieval"].values()]
    lines += [f"retrieval of gold passages among {d['eval_passages']} held-out passages (ScaNN; BM25), "
              f"{d['eval_questions']} questions:",
              table(["retriever", *[f"recall@{c}" for c in ks], *[f"hit@{c}" for c in ks]], rows), ""]
    first = next(iter(qa["conditions"].values()))
    extra = EXTRA_SCORES if "answer_recall" in first else ()
    rows = [[CONDITION_LABELS[c].format(k=k), *[v[key] for key, _ in extra], v["set_em"], v["set_f1"], v["f1"],
             v["seconds"]] for c, v in qa["conditions"].items()]
    lines += [f"answers to {qa['num_questions']} held-out questions (retriever: {qa['retriever']}; greedy):",
              table(["condition", *[name for _, name in extra], "EM", "set-F1", "token-F1", "seconds"], rows)]
    kv = qa.get("kv_store")
    if kv:
        lines.append(f"passage KV store: {kv['entries']} cached blocks ({kv['bytes'] / 2**20:.1f} MiB), "
                     f"{kv['hits']} hits / {kv['misses']} misses")
    if report["ttft"]:
        rows = [[r["passages"], r["prompt_tokens"], r["full_ms"], r["cached_ms"], r["speedup"]] for r in report["ttft"]]
        lines += ["", "time to first token (ms, median; cached = Block-Attention with warm passage KV):",
                  table(["passages", "tokens", "full ms", "cached ms", "speedup"], rows)]
    if qa.get("examples"):
        lines += ["", "examples (held-out):"]
        for ex in qa["examples"]:
            lines.append(f"  Q: {ex['question']}  gold: {answer_text(ex['gold'])}")
            lines.append(f"     no retrieval: {ex['no_retrieval']!r}   with retrieval (block): {ex['retrieval_block']!r}")
    lines += ["", "files: " + ", ".join(f"{k}={v}" for k, v in report["files"].items()),
              f"total: {report['total_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU; stages (wall/CPU s): "
              + ", ".join(f"{k} {v:.0f}/{report['cpu_timings'][k]:.0f}" for k, v in report["timings"].items()),
              "=" * 78]
    return "\n".join(lines)


def check_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and check a file can be written there (before any compute).

    Raises:
      PermissionError: the folder cannot be created or written (the message says why).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"output directory {str(path)!r} is not writable ({e.strerror or e}); "
                              "pass --out with a writable folder") from None
    return path


def write_report(report: dict, timer, out: Path, log) -> dict:
    """Close the timing (``timings`` / ``cpu_timings`` per stage, ``total_seconds`` / ``cpu_seconds``), write
    ``out/metrics.json`` atomically and log the printed summary; returns ``report``."""
    import json

    timer.stage("report")
    report.update(timings=timer.wall, cpu_timings=timer.cpu)
    report["total_seconds"], report["cpu_seconds"] = timer.total()
    write_text(out / "metrics.json", json.dumps(report, indent=1, default=float))
    log(format_report(report))
    return report
