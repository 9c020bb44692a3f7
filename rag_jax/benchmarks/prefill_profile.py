"""Where a SmolLM2 prefill spends its time on CPU: an XLA:CPU trace aggregated per op class.

Runs the same compiled forward as ``rag-jax bench attention`` (last-token logits, ``attention_impl``
``--impl``) once under ``jax.profiler`` with ``--xla_cpu_enable_xprof_traceme`` (one trace event per XLA
thunk), maps every thunk to its HLO instruction and that instruction's Python source frame (the HLO's
stack-frame table; fusions without metadata inherit their body's or their caller's frame), and sums
each XLA thread's *exclusive* thunk time per class: the model function (RMSNorm, q/k/v and o
projections, RoPE, SwiGLU, blockwise attention, LM head) split into matmul thunks (``dot`` inside,
XNNPACK ``ynn_fusion`` on this jaxlib) and the rest (elementwise / reductions), plus layout copies.
``(no thunk)`` is thread time inside the executor with no thunk of its own running: helping another
thread's parallel thunk, waiting for a dependency, or preempted. Percentages are of the XLA threads'
total (threads x wall), so ``(no thunk)`` also shows how much of the second core went unused.

    python -m rag_jax.benchmarks.prefill_profile --sizes 1024,8192 --threads 2   # bench/PROFILE.md
"""
from __future__ import annotations

import collections
import glob
import os
import re
import sys
import tempfile
import time

CLASSES = {"RMSNorm": "RMSNorm", "Attention.project_qkv": "q/k/v projection", "Attention.output": "o projection",
           "MLP": "MLP (SwiGLU)", "Transformer.logits": "LM head", "Transformer.embed": "embedding"}
MATMUL_SPLIT = ("MLP (SwiGLU)", "attention", "q/k/v projection", "o projection", "LM head")


def parse_hlo(text: str):
    """HLO text -> (instructions {name: dict(op, calls, frame)}, computations {name: [instr]}, source(name))."""
    def section(name):
        return text.split("\n" + name + "\n", 1)[1].split("\n\n", 1)[0]
    files = dict(re.findall(r'^(\d+) "(.*)"$', section("FileNames"), re.M))
    funcs = dict(re.findall(r'^(\d+) "(.*)"$', section("FunctionNames"), re.M))
    locs = {i: (files[f], funcs[fn]) for i, f, fn in
            re.findall(r'^(\d+) \{file_name_id=(\d+) function_name_id=(\d+)', section("FileLocations"), re.M)}
    frames = {i: (loc, par) for i, loc, par in
              re.findall(r'^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)', section("StackFrames"), re.M)}
    instr, comps, parent, cur = {}, {}, {}, None
    for line in text.splitlines():
        m = re.match(r'^(?:ENTRY )?%(\S+) .*\{$', line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            continue
        m = re.match(r'^\s+(?:ROOT )?%(\S+) = (.*)$', line)
        if m and cur:
            name, rest = m.groups()
            comps[cur].append(name)
            parent[name] = cur
            op = re.match(r'\S+(?:\{[^}]*\})? (\S+?)\(', rest)
            calls = re.findall(r'(?:calls|to_apply|body|condition)=%([\w.\-]+)', rest)
            branches = re.search(r'branch_computations=\{([^}]*)\}', rest)
            calls += re.findall(r'%([\w.\-]+)', branches.group(1)) if branches else []
            frame = re.search(r'stack_frame_id=(\d+)', rest)
            instr[name] = dict(op=op.group(1) if op else "?", calls=calls, frame=frame and frame.group(1))
    caller = {}
    for n, i in instr.items():
        for c in i["calls"]:
            caller.setdefault(c, n)

    def frame_of(name, depth=0):
        i = instr.get(name)
        if i is None or depth > 8:
            return None
        if i["frame"]:
            return i["frame"]
        for c in i["calls"]:  # a fusion without metadata: its dot's frame, else any body op's
            for j in sorted((instr[n] for n in comps.get(c, [])), key=lambda j: j["op"] != "dot"):
                if j["frame"]:
                    return j["frame"]
        up = caller.get(parent.get(name))  # an op in a loop / branch body: the loop's frame
        return frame_of(up, depth + 1) if up else None

    def source(name):
        fid, hops = frame_of(name), 0
        while fid and hops < 64:
            loc, par = frames[fid]
            path, fn = locs[loc]
            if "rag_jax/model/" in path:
                return path.split("rag_jax/model/")[1], fn
            if par == fid:
                break
            fid, hops = par, hops + 1
        return "", ""
    return instr, comps, source


def ops_in(instr, comps, name, depth=0) -> set[str]:
    i = instr.get(name)
    if not i or depth > 4:
        return set()
    return {i["op"]}.union(*(ops_in(instr, comps, n, depth + 1) for c in i["calls"] for n in comps.get(c, [])))


def op_class(path: str, fn: str, ops: set[str]) -> str:
    if ops <= {"copy", "transpose", "bitcast", "parameter"} or (ops & {"copy", "transpose"} and "dot" not in ops
                                                                and len(ops - {"bitcast", "parameter"}) == 1):
        return "copies / transposes (layout)"
    if path == "rope.py":
        c = "RoPE"
    elif path in ("blockwise.py", "attention.py", "masks.py", "kernels.py"):
        c = "attention"
    else:
        c = next((v for k, v in CLASSES.items() if fn.startswith(k)), "residual adds, other")
    if c in MATMUL_SPLIT:
        c += ": matmul" if "dot" in ops else ": elementwise / reduce"
    return c


def aggregate(xspace_path: str, hlo_text: str):
    """-> ({class: thread ns}, wall ns of the execution, number of XLA worker threads)."""
    import jax
    instr, comps, source = parse_hlo(hlo_text)
    data = jax.profiler.ProfileData.from_file(xspace_path)
    excl, wall, threads = collections.Counter(), 0, 0
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            evs = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events
                          if not e.name.startswith(("end: ", "ThreadpoolListener", "$"))), key=lambda e: (e[0], -e[1]))
            if line.name.startswith("tf_XLAPjRt"):  # the caller: waits for the whole execution
                wall = max((d for s, d, n in evs if n.startswith("ThunkExecutor::Execute (wait")), default=wall)
                evs = [e for e in evs if not e[2].startswith("ThunkExecutor")]
            elif not line.name.startswith("tf_XLA"):
                continue
            else:
                threads += 1
            stack = []
            for s, d, n in evs:
                while stack and stack[-1][0] <= s:
                    end, name, child, dur = stack.pop()
                    excl[name] += dur - child
                if stack:
                    stack[-1][2] += d
                stack.append([s + d, n, 0, d])
            for end, name, child, dur in stack:
                excl[name] += dur - child
    out = collections.Counter()
    for name, ns in excl.items():
        if name in instr and instr[name]["op"] not in ("while", "conditional"):
            out[op_class(*source(name), ops_in(instr, comps, name))] += ns
        elif name.startswith("SlinkyThreadPool::Await"):
            out["(no thunk: waiting in a parallel thunk)"] += ns
        else:  # executor, loop and branch bookkeeping
            out["(no thunk: executor, loops, idle, preempted)"] += ns
    busy = sum(out.values())
    out["(no thunk: executor, loops, idle, preempted)"] += max(0, threads * wall - busy)
    return out, wall, threads


def profile(length: int, impl: str, repeats: int) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rag_jax.evaluation.timing import median_ms
    from rag_jax.model.load import load_model
    model = load_model("smollm2-135m-instruct").model
    model.config = model.config.replace(attention_impl=impl, max_seq_len=max(model.config.max_seq_len, length))
    graphdef, state = nnx.split(model)

    def fwd(state, tokens, positions, segment_ids):
        m = nnx.merge(graphdef, state)
        return m.logits(m(tokens, positions, segment_ids).hidden[:, -1:])

    toks = jnp.asarray(np.random.default_rng(0).integers(1, 4000, (1, length)), jnp.int32)
    pos, seg = jnp.arange(length, dtype=jnp.int32)[None], jnp.ones_like(toks)
    compiled = jax.jit(fwd).lower(state, toks, pos, seg).compile()
    run = lambda: compiled(state, toks, pos, seg).block_until_ready()  # noqa: E731
    cpu0, t0 = time.process_time(), time.perf_counter()
    wall_ms = median_ms(run, repeats, warmup=1) if repeats else None  # 0: the traced run only
    cpu_per_wall = (time.process_time() - cpu0) / (time.perf_counter() - t0) if repeats else None
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        run()
        jax.profiler.stop_trace()
        classes, traced_ns, threads = aggregate(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[-1],
                                                compiled.as_text())
    return dict(tokens=length, wall_ms=wall_ms, cpu_per_wall=cpu_per_wall, traced_ms=traced_ns / 1e6,
                threads=threads, classes={k: v / 1e6 for k, v in classes.items()})


def main(argv=None) -> int:
    from rag_jax.args import ScriptParser  # imported here like the rest: JAX loads after the affinity is set
    p = ScriptParser(prog="python -m rag_jax.benchmarks.prefill_profile", description=__doc__)
    p.add_argument("--sizes", default="1024,8192", help="prompt lengths, comma-separated")
    p.add_argument("--impl", default="blockwise")
    p.add_argument("--threads", type=int, default=2, help="cores (CPU affinity, as taskset); 0 = unpinned")
    p.add_argument("--repeats", type=int, default=3, help="untraced timed prefills (median, after a warm-up) before the trace; 0: the traced run only")
    args = p.parse_args(argv)
    from rag_jax.evaluation.timing import cpu_threads
    cores = cpu_threads(args.threads)
    load = os.getloadavg()
    print(f"SmolLM2-135M fp32 prefill, attention_impl={args.impl}, cores {cores or 'unpinned'}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    for n in args.sizes.split(","):
        r = profile(int(n), args.impl, args.repeats)
        timed = (f"median wall {r['wall_ms']:.0f} ms ({r['tokens'] / r['wall_ms'] * 1e3:.0f} tokens/s), CPU/wall "
                 f"{r['cpu_per_wall']:.2f}; " if r["wall_ms"] else "")
        load = os.getloadavg()
        print(f"\n{r['tokens']} tokens: {timed}traced run {r['traced_ms']:.0f} ms "
              f"({r['tokens'] / r['traced_ms'] * 1e3:.0f} tokens/s) on {r['threads']} XLA threads; load average "
              f"{load[0]:.2f}\n")
        total = sum(r["classes"].values())
        print("| op class | thread ms | % of threads x wall |\n|---|---:|---:|")
        for name, ms in sorted(r["classes"].items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {ms:.0f} | {100 * ms / total:.1f} |", flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
