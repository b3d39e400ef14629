"""The library's import graph, read from the source (AST, nothing imported): no import circle
between any two modules, type-only and function-level imports included, and every package
imports only the packages below it (DESIGN.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "steps", "graphcap", "kvcache", "attention", "distributed", "models", "engine")
# What each package may import of ours (besides itself).
ALLOWED = {
    "common": set(),
    "steps": {"common"},
    "graphcap": {"common"},
    "kvcache": {"common", "graphcap"},
    "attention": {"common", "steps", "graphcap", "kvcache"},
    "distributed": {"common"},
    "models": {"common", "steps", "graphcap", "kvcache", "attention", "distributed"},
    "engine": {"common", "steps"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path], missing: list[str] | None = None) -> set[str]:
    """Our modules ``name`` imports, anywhere in the file (the most specific module named);
    ``missing`` collects imports of our packages that name no module (a moved file)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        ours = [t for t in targets if t.split(".")[0] in PACKAGES]
        if missing is not None:
            missing += [f"{name} imports {t}" for t in ours if t not in modules]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_graph_is_read_from_every_package():
    g = graph()
    assert {m.split(".")[0] for m in g} == set(PACKAGES)
    assert "models.minimax_m3.ops" in g["models.minimax_m3.model"]  # the reader resolves relative imports
    assert "graphcap.startup.jit_cache" in g["graphcap.manager"]


def test_every_import_of_ours_names_a_module_that_exists():
    modules, missing = library_modules(), []
    for name, path in modules.items():
        imports_of(name, path, modules, missing)
    assert not missing, missing


def test_no_import_circle_between_library_modules():
    g = graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(g):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_package_imports_only_what_lies_below_it():
    bad = sorted(f"{src} imports {dst}" for src, dsts in graph().items() for dst in dsts
                 if dst.split(".")[0] != src.split(".")[0] and dst.split(".")[0] not in ALLOWED[src.split(".")[0]])
    assert not bad, bad


def test_the_engine_imports_neither_attention_nor_models():
    engine = {src: dsts for src, dsts in graph().items() if src.startswith("engine")}
    assert engine
    assert not [d for dsts in engine.values() for d in dsts if d.split(".")[0] in ("attention", "models")]
