"""The reading path of one batched eval forward: the ltmp functions it runs, and how much code they are.

What it counts: every Python function of the ``ltmp`` package (its files under ``src/ltmp``) that one batched
eval forward of a patched model runs, found by tracing, not by a hand-written list. The bundled CIFAR-10 ViT
(``../shared/models/vit-cifar10`` where it exists, else ``ltmp.demo.BUNDLED_MODEL``) is patched with LTMP and
learned-looking thresholds (merge ``--merge``, prune ``--prune`` per block) under which the ``--batch`` test images
keep different token counts, with both merging and pruning happening (the script checks both). After one warm-up
forward (eval mode, no gradients), ``sys.setprofile`` records the code object of every Python call of a second
forward; each distinct function is kept once, in the order it first ran.

How: each function's whole source is its node in its module's AST: decorators, body and nested functions. A
nested function, lambda or comprehension that ran counts as part of its enclosing function when that one ran too,
else on its own (a closure made by ``ltmp.patch`` runs without its maker). Code without a source file (the
``__init__`` that ``dataclasses`` generates) is listed as skipped. For each function:

- statements: the ``ast.stmt`` nodes of its subtree (the ``def`` counts as 1; a lambda or comprehension on its own
  as 1), without docstrings;
- code tokens: the ``tokenize`` tokens of its source, without comments, docstrings, indentation, line ends and
  the encoding/end markers.

Docstrings and comments are excluded and formatting does not matter: statements and tokens, not lines.

It also counts the modules a forward is made of (``FORWARD_MODULES``: the maths, the step, the engine, patching,
the forward's config and the errors; not the adapters, the record, FLOPs, calibration, export, data, runtime or
command layers), whole files, the same way.

    python benchmarks/reading_path.py [--method ltmp|ltpm|ltm|ltp|tome] [--merge 0.9] [--prune 0.0138] [--r 4]
        [--batch 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import sys
import tokenize
from collections import Counter
from functools import cache
from pathlib import Path
from types import CodeType, FrameType

import timm
import torch

import ltmp
from common import cifar_model_name, load_images
from ltmp.config import LEARNED, METHODS

PACKAGE = Path(ltmp.__file__).resolve().parent
FORWARD_MODULES = ("ops", "step", "engine", "patching", "config", "errors")
SKIPPED_TOKENS = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
SCOPE_NAMES = {
    ast.Lambda: "<lambda>",
    ast.ListComp: "<listcomp>",
    ast.SetComp: "<setcomp>",
    ast.DictComp: "<dictcomp>",
    ast.GeneratorExp: "<genexpr>",
}


@dataclasses.dataclass
class Function:
    """One function that ran, and the size of its whole source."""

    file: str  # relative to the package folder
    name: str  # the code object's qualified name
    line: int  # first line (of the first decorator, if any)
    statements: int
    tokens: int


@dataclasses.dataclass
class Module:
    """One source file of the package: its tokens, its docstrings' spans and its function-like nodes."""

    tokens: list[tokenize.TokenInfo]
    docstrings: list[tuple[tuple[int, int], tuple[int, int]]]  # (start, end) positions of each docstring
    nodes: dict[tuple[str, int], ast.AST]  # (qualified name, first line) -> def, lambda or comprehension


def first_line(node: ast.AST) -> int:
    """The line a code object of ``node`` starts on: its first decorator's for a decorated def or class."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def span(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (line, column) start and end of ``node``'s source, decorators included (they share its column)."""
    return (first_line(node), node.col_offset), (node.end_lineno, node.end_col_offset)


def docstring(node: ast.AST) -> ast.Expr | None:
    """The docstring statement of a module, class or def: a bare string as its first statement."""
    if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
        return None
    first = node.body[0]
    is_doc = (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    )
    return first if is_doc else None


def index(tree: ast.Module) -> dict[tuple[str, int], ast.AST]:
    """Every def, lambda and comprehension of a module by the qualified name and first line its code object has."""
    found: dict[tuple[str, int], ast.AST] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, *SCOPES)):
                name = prefix + getattr(child, "name", SCOPE_NAMES.get(type(child)))
                if isinstance(child, SCOPES):
                    found.setdefault((name, first_line(child)), child)
                visit(child, name + ("." if isinstance(child, ast.ClassDef) else ".<locals>."))
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


@cache
def module(path: Path) -> Module:
    """The parsed source file at ``path``."""
    text = path.read_text()
    tree = ast.parse(text)
    docs = [span(d) for d in map(docstring, ast.walk(tree)) if d is not None]
    return Module(list(tokenize.generate_tokens(io.StringIO(text).readline)), docs, index(tree))


def measure(path: Path, node: ast.AST) -> tuple[int, int]:
    """The statements and code tokens of ``node``'s whole source, without docstrings and comments."""
    mod = module(path)
    docs = {id(d) for d in map(docstring, ast.walk(node)) if d is not None}
    statements = sum(isinstance(n, ast.stmt) and id(n) not in docs for n in ast.walk(node))
    start, end = span(node)
    tokens = sum(
        start <= t.start < end and t.type not in SKIPPED_TOKENS and not any(a <= t.start < b for a, b in mod.docstrings)
        for t in mod.tokens
    )
    return statements or 1, tokens  # a lambda or comprehension has no statement: its expression is one


def file_size(path: Path) -> tuple[int, int]:
    """The statements and code tokens of a whole source file, without docstrings and comments."""
    mod, tree = module(path), ast.parse(path.read_text())
    docs = {id(d) for d in map(docstring, ast.walk(tree)) if d is not None}
    statements = sum(isinstance(n, ast.stmt) and id(n) not in docs for n in ast.walk(tree))
    tokens = sum(
        t.type not in SKIPPED_TOKENS and not any(a <= t.start < b for a, b in mod.docstrings) for t in mod.tokens
    )
    return statements, tokens


def enclosing(name: str) -> list[str]:
    """The qualified names of the functions that ``name`` is nested in, outermost first."""
    parts = name.split(".<locals>.")
    return [".<locals>.".join(parts[:i]) for i in range(1, len(parts))]


def patched(method: str, merge: float, prune: float, r: int) -> torch.nn.Module:
    """The bundled CIFAR-10 ViT patched with ``method``: thresholds for the learned methods, ``r`` for ToMe."""
    model = timm.create_model(cifar_model_name(), pretrained=True)
    if method == "tome":
        return ltmp.patch(model, "tome", r=r).eval()
    return ltmp.patch(model, method, merge_threshold=merge, prune_threshold=prune).eval()


def check(model: torch.nn.Module, method: str) -> None:
    """Assert that the last forward reduced as intended: every operation of ``method`` removed tokens, and with
    learned thresholds the images kept different token counts."""
    record = ltmp.stats(model)
    ops = METHODS[method][0]
    assert "merge" not in ops or record.merged.sum() > 0, "no token merged"
    assert "prune" not in ops or record.pruned.sum() > 0, "no token pruned"
    if method in LEARNED:
        assert record.kept[:, -1].unique().numel() > 1, "all images keep the same token count"


def trace(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[CodeType], list[str]]:
    """The package's code objects one forward of ``model`` on ``x`` calls, in the order they first ran, and the
    qualified names of generated package code without a source file (a dataclass's ``__init__``)."""
    seen: set[CodeType] = set()
    calls: dict[CodeType, None] = {}
    generated: dict[str, None] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event != "call" or code in seen:
            return
        seen.add(code)
        if Path(code.co_filename).resolve().is_relative_to(PACKAGE):
            calls[code] = None
        elif not Path(code.co_filename).is_file() and frame.f_globals.get("__name__", "").startswith("ltmp."):
            owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # self of a method
            name = code.co_qualname if owner is None else f"{type(owner).__qualname__}.{code.co_name}"
            generated[f"{frame.f_globals['__name__']}: {name}"] = None

    sys.setprofile(profile)
    try:
        model(x)
    finally:
        sys.setprofile(None)
    return list(calls), list(generated)


def reading_path(codes: list[CodeType]) -> tuple[list[Function], list[str]]:
    """The functions that ``codes`` run, each measured once, nested code counted with a traced enclosing function;
    and notes on the code objects with no source node."""
    ran = {(c.co_filename, c.co_qualname) for c in codes}
    functions: list[Function] = []
    notes: list[str] = []
    for code in codes:
        path = Path(code.co_filename).resolve()
        rel = path.relative_to(PACKAGE).as_posix()
        if any((code.co_filename, outer) in ran for outer in enclosing(code.co_qualname)):
            continue
        node = module(path).nodes.get((code.co_qualname, code.co_firstlineno))
        if node is None:
            notes.append(f"{rel}:{code.co_firstlineno} {code.co_qualname}: no source node, skipped")
            continue
        functions.append(Function(rel, code.co_qualname, code.co_firstlineno, *measure(path, node)))
    return functions, notes


def report(functions: list[Function], notes: list[str]) -> dict:
    """Print the table, the notes and the totals; return them as one dict."""
    width = max(len(f"{f.file}:{f.name}") for f in functions)
    print(f"{'file:function':<{width}} {'line':>5} {'stmts':>6} {'tokens':>7}")
    for f in functions:
        print(f"{f.file + ':' + f.name:<{width}} {f.line:>5} {f.statements:>6} {f.tokens:>7}")
    for note in notes:
        print(f"note: {note}")
    files: dict[str, Counter] = {}
    for f in functions:
        files.setdefault(f.file, Counter()).update(functions=1, statements=f.statements, tokens=f.tokens)
    totals = dict(
        functions=len(functions),
        files=len(files),
        statements=sum(f.statements for f in functions),
        tokens=sum(f.tokens for f in functions),
    )
    print(
        f"\n{totals['functions']} functions in {totals['files']} files, {totals['statements']} statements, "
        f"{totals['tokens']:,} code tokens"
    )
    for file, c in sorted(files.items(), key=lambda kv: -kv[1]["tokens"]):
        print(
            f"  {file:<{width - 2}} {c['functions']:>3} functions {c['statements']:>5} statements "
            f"{c['tokens']:>6} tokens"
        )
    return dict(
        functions=[dataclasses.asdict(f) for f in functions],
        notes=notes,
        totals=totals,
        files={k: dict(v) for k, v in files.items()},
    )


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="ltmp", choices=[*LEARNED, "tome"])
    p.add_argument("--merge", type=float, default=0.9, help="merge threshold of every block (learned methods)")
    p.add_argument("--prune", type=float, default=0.9 / 65, help="prune threshold of every block (learned methods)")
    p.add_argument("--r", type=int, default=4, help="ToMe's tokens merged per layer")
    p.add_argument("--batch", type=int, default=8, help="test images in the traced batch")
    p.add_argument("--json", type=Path, help="also write the table, notes and totals to this file")
    args = p.parse_args()
    model = patched(args.method, args.merge, args.prune, args.r)
    x = load_images(model, "test", args.batch)
    model(x)  # warm-up: caches and lazy imports are not the reading path
    check(model, args.method)
    codes, generated = trace(model, x)
    functions, notes = reading_path(codes)
    notes += [f"{name}: generated, no source file, skipped" for name in generated]
    kept = ltmp.stats(model).kept[:, -1].tolist()
    print(f"{args.method} on {cifar_model_name()}, batch {args.batch}, tokens kept after the last block: {kept}\n")
    result = report(functions, notes)
    sizes = {name: file_size(PACKAGE / f"{name}.py") for name in FORWARD_MODULES}
    result["forward_modules"] = {
        "statements": sum(s for s, _ in sizes.values()),
        "tokens": sum(t for _, t in sizes.values()),
    }
    print(
        f"\nthe forward's modules ({', '.join(FORWARD_MODULES)}): {result['forward_modules']['statements']} "
        f"statements, {result['forward_modules']['tokens']:,} code tokens"
    )
    if args.json:
        args.json.write_text(json.dumps(dict(method=args.method, batch=args.batch, kept=kept, **result), indent=1))


if __name__ == "__main__":
    main()
