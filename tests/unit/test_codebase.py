"""The codebase keeps the house rules a newcomer relies on: the core never imports tools or
applications, top-level imports form no circle, no file over ~600 lines, no function over ~60."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "unbroken"
CORE = {"runtime", "protect", "parallel", "comm", "detect"}
NOT_FROM_CORE = {"sim", "plan", "bench", "rl", "serve", "split", "predict"}
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 70  # ~60 for a body; a typer command's options add lines


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def test_the_core_never_imports_tools_or_applications():
    wrong = []
    for name, tree in _modules().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in CORE:
            continue
        for node in ast.walk(tree):  # lazy imports inside functions count too
            for target in _imported(node):
                tp = target.split(".")
                if tp[0] == "unbroken" and len(tp) > 1 and tp[1] in NOT_FROM_CORE:
                    wrong.append(f"{name} imports {target}")
    assert wrong == []


def test_module_level_imports_form_no_circle():
    mods = _modules()
    graph = {name: sorted({t for node in tree.body for t in _imported(node) if t in mods and t != name})
             for name, tree in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                return path + [n, m]
            if m not in state and (cycle := visit(m, path + [n])):
                return cycle
        state[n] = 2
        return None

    for name in graph:
        if name not in state:
            cycle = visit(name, [])
            assert cycle is None, " -> ".join(cycle[cycle.index(cycle[-1]):])


def test_files_and_functions_stay_small():
    big_files, big_functions = [], []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            big_files.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    big_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert big_files == [] and big_functions == []
