"""Layering of ``kernels/`` (docs/design.md): it never imports ``harness``, its modules import one
another without a circle (lazy imports inside functions count), and importing the package patches
nothing (the interpreter's speed-ups are installed explicitly)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "kernels")


def _modules() -> dict:
    """``{dotted name under mla_fuzz.kernels: path}`` of every module of the package."""
    out = {}
    for folder, _, files in os.walk(KERNELS):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), KERNELS)[:-3].replace(os.sep, ".")
                name = "mla_fuzz.kernels" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))
                out[name] = os.path.join(folder, f)
    return out


def _imports(name: str, path: str, package: bool) -> set:
    """Absolute names of everything ``path`` imports, anywhere in the file."""
    base = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                mod = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return found


def test_kernels_never_import_harness_and_have_no_import_circle():
    mods = _modules()
    assert "mla_fuzz.kernels.routes" in mods and "mla_fuzz.kernels.hopper.decode_wgmma" in mods
    graph = {}
    for name, path in mods.items():
        imported = _imports(name, path, path.endswith("__init__.py"))
        bad = sorted(m for m in imported if m.startswith(("mla_fuzz.harness", "harness")))
        assert not bad, f"{name} imports {bad}"
        # edges to modules of the package (a name imported from a module is that module)
        graph[name] = {m for m in mods if m != name and any(i == m or i.startswith(m + ".") for i in imported)
                       and not name.startswith(m + ".")}  # a package's own __init__ above it: not a circle
        graph[name].discard("mla_fuzz.kernels")
    state: dict = {}

    def visit(n, stack):
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


def test_importing_the_kernels_patches_nothing():
    """The package's import installs none of ``interpreter_patches`` (and needs no harness)."""
    code = ("import sys, triton.language.core as core\n"
            "from triton.runtime import interpreter\n"
            "import mla_fuzz.kernels\n"
            "assert not any(m.startswith('mla_fuzz.harness') for m in sys.modules), 'harness imported'\n"
            "assert not getattr(core.tensor.__init__, '_mla_fuzz', False)\n"
            "assert not getattr(interpreter._patch_lang, '_mla_fuzz', False)\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"), check=True,
                   timeout=300)
