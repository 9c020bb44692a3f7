"""The import graph of ``rag_jax``: layers only look down, no cycle, few imports inside functions.

Every module is parsed with ``ast`` (nothing is imported); every ``import`` / ``from ... import`` of a
``rag_jax`` module, at top level or inside a function, is an edge from the importing module to the
imported one (``from pkg import name`` resolves to ``pkg.name`` when that is a module). A module's
package is its first name below ``rag_jax`` (``rag_jax.model.load`` -> ``model``, ``rag_jax.metrics`` ->
``metrics``); a ``__main__`` module is an entry point and sits with ``cli``.

Run ``python tests/test_layers.py`` for the counts (cycles, upward imports, imports inside functions,
files over 500 lines, functions over 80 lines).
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rag_jax"

# Lowest first; a package may import its own layer's other packages (without a cycle) and any lower one.
# inference (generation, KV caches, chat) needs only the model, so it sits below data: data/grit.py renders
# chat prompts with inference/chat.py until the shared text module lands.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(s.split()) for s in (
    "rag_jax atomic config metrics sharding distributed text tokenizer progress file_errors",
    "model",
    "args",
    "inference",
    "data",
    "retrieval",
    "memory",
    "train",
    "evaluation",
    "recipes",
    "benchmarks",
    "cli __main__",
))

# Upward imports still present, each with the reason it remains: (importer module, imported module).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

# File-level import cycles still present (each a tuple of the modules in the cycle, sorted), with reasons.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}

# Package-level cycles still present, with reasons.
ALLOWED_PACKAGE_CYCLES: dict[tuple[str, ...], str] = {}

# Package-internal imports inside functions: 197 before issue 26. Left: cli.py's lazy dispatch (``rag-jax --help``
# imports no subcommand, 7) and benchmarks/prefill_profile.py (4: JAX loads after the CPU affinity is set).
MAX_FUNCTION_IMPORTS = 11

# Modules that construct an ``argparse.ArgumentParser`` themselves (every other script builds ``rag_jax.args.
# ScriptParser``: one-line errors, one set of argument types). 8 before issue 26.
SCRIPT_ROOTS = ("rag_jax", "train", "eval", "bench")
ALLOWED_PARSER_BUILDERS = {
    "eval/reference/run_em_llm_reference.py": "runs the reference EM-LLM code in its own venv, without rag_jax",
}


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str        # importing module, e.g. "rag_jax.model.load"
    dst: str        # imported module
    in_function: bool
    line: int


def modules() -> dict[str, Path]:
    """``{"rag_jax.model.load": path}`` for every ``.py`` file of the package (``__init__`` -> the package)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != "rag_jax":
            continue
        while name not in known:  # rag_jax.model.load.load_model -> rag_jax.model.load
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return sorted(set(out))


def edges() -> list[Edge]:
    """Every package-internal import of ``rag_jax`` (one Edge per imported module per statement)."""
    known = modules()
    out = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nested = {id(c) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for c in ast.walk(f) if c is not f}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out += [Edge(module, dst, id(node) in nested, node.lineno)
                        for dst in _targets(module, path, node, known) if dst != module]
    return out


def package(module: str) -> str:
    parts = module.split(".")
    return "__main__" if parts[-1] == "__main__" else parts[1] if len(parts) > 1 else "rag_jax"


def layer(module: str) -> int:
    pkg = package(module)
    for i, names in enumerate(LAYERS):
        if pkg in names:
            return i
    raise AssertionError(f"package {pkg!r} ({module}) is in no layer of LAYERS; add it where it belongs")


def upward(all_edges: list[Edge]) -> list[Edge]:
    return [e for e in all_edges if layer(e.dst) > layer(e.src)]


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one node (Tarjan), each as a sorted tuple."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def file_graph(all_edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        graph.setdefault(e.src, set()).add(e.dst)
    return graph


def package_graph(all_edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        if package(e.src) != package(e.dst):
            graph.setdefault(package(e.src), set()).add(package(e.dst))
    return graph


def long_functions(limit: int = 80) -> list[str]:
    out = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                out.append(f"{module}.{node.name}")
    return out


def counts() -> dict[str, int]:
    all_edges = edges()
    return {
        "file cycles": len(cycles(file_graph(all_edges))),
        "package cycles": len(cycles(package_graph(all_edges))),
        "upward imports": len({(e.src, e.line) for e in upward(all_edges)}),
        "imports inside functions": len({(e.src, e.line) for e in all_edges if e.in_function}),
        "files over 500 lines": sum(len(p.read_text().splitlines()) > 500 for p in modules().values()),
        "functions over 80 lines": len(long_functions()),
        "modules building an ArgumentParser": len(parser_builders()),
    }


def parser_builders() -> list[str]:
    """Files under ``SCRIPT_ROOTS`` that call ``ArgumentParser(...)`` (``argparse.ArgumentParser`` or the bare
    name), relative to the repository root."""
    repo = ROOT.parent
    out = []
    for top in SCRIPT_ROOTS:
        for path in sorted((repo / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            if any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "ArgumentParser"
                   for n in ast.walk(tree)):
                out.append(str(path.relative_to(repo)))
    return out


def test_every_package_has_a_layer():
    for module in modules():
        layer(module)


def test_imports_only_look_down():
    found = {(e.src, e.dst): e for e in upward(edges())}
    bad = [f"{e.src}:{e.line} imports {e.dst} ({package(e.src)} is below {package(e.dst)})"
           for key, e in sorted(found.items()) if key not in ALLOWED_UPWARD]
    assert bad == []
    assert sorted(set(ALLOWED_UPWARD) - set(found)) == [], "an allowed upward import is gone: drop it from the list"


def test_no_file_cycle():
    found = cycles(file_graph(edges()))
    assert [c for c in found if c not in ALLOWED_CYCLES] == []
    assert sorted(set(ALLOWED_CYCLES) - set(found)) == [], "an allowed cycle is gone: drop it from the list"


def test_no_package_cycle():
    assert cycles(package_graph(edges())) == sorted(ALLOWED_PACKAGE_CYCLES)


def test_few_imports_inside_functions():
    n = counts()["imports inside functions"]
    assert n <= MAX_FUNCTION_IMPORTS, f"{n} package-internal imports inside functions (at most " \
                                      f"{MAX_FUNCTION_IMPORTS}); import at the top unless the module pulls in an " \
                                      "optional heavy dependency"


def test_one_argument_parser():
    assert [f for f in parser_builders() if f not in ALLOWED_PARSER_BUILDERS] == [], \
        "build rag_jax.args.ScriptParser instead of argparse.ArgumentParser"
    assert "rag_jax/args.py" not in parser_builders()  # it subclasses, it does not build one


def test_the_analysis_sees_what_it_should():
    """The cycle finder and the edge parser on known inputs."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert cycles({"a": {"b"}, "b": set()}) == []
    load = [e for e in edges() if e.src == "rag_jax.model.load"]
    assert any(e.dst == "rag_jax.model.config" and not e.in_function for e in load)
    assert package("rag_jax.model.load") == "model" and package("rag_jax.metrics") == "metrics"
    assert package("rag_jax.recipes.rag_demo.__main__") == "__main__"


if __name__ == "__main__":
    all_edges = edges()
    for name, value in counts().items():
        print(f"{name}: {value}")
    for c in cycles(file_graph(all_edges)):
        print("file cycle:", " -> ".join(c))
    for c in cycles(package_graph(all_edges)):
        print("package cycle:", " -> ".join(c))
    for e in sorted(upward(all_edges), key=lambda e: (e.src, e.line)):
        print(f"upward: {e.src}:{e.line} -> {e.dst}")
