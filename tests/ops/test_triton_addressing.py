"""Static check of the Triton kernels' addressing rule (docs/triton.md, "Addressing"): an index that comes from
the launch grid (`tl.program_id`, directly or through a helper, a loop bound or a value loaded with it) is
promoted to int64 before it is multiplied by a stride (any name containing "stride"). In int32 such a product
wraps past 2^31 elements and the kernel reads or writes outside its tensors.

The analysis reads the source (no Triton needed): per jit function, each variable is "grid-derived" or not and
"int64" or not, joined over all its assignments (flow-insensitive) and over all call sites of a helper's
parameters, iterated to a fixed point. It is deliberately narrow: products with a stride only, so that it has
no false positives on this backend; products of sizes (rows x columns) are covered by the GPU tests past 2^31
(tests/gpu/test_large_offsets.py) and the interpreter's far-row checks.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "rl_kernel" / "backends" / "triton"


def _is_jit(fn: ast.FunctionDef) -> bool:
    """Decorated with triton.jit (or jit), with or without arguments."""

    def jit(d: ast.expr) -> bool:
        return isinstance(d, ast.Attribute) and d.attr == "jit" or isinstance(d, ast.Name) and d.id == "jit"

    return any(jit(d.func if isinstance(d, ast.Call) else d) for d in fn.decorator_list)


def _is_stride(node: ast.expr) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Name) and "stride" in node.id.lower()


def _is_int64(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "int64"


def _join(a: tuple[bool, bool] | None, b: tuple[bool, bool]) -> tuple[bool, bool]:
    return b if a is None else (a[0] or b[0], a[1] and b[1])


@dataclass
class Addressing:
    """Grid-derived int32 indices multiplied by a stride, over a set of jit functions."""

    functions: dict[str, ast.FunctionDef]
    params: dict[str, dict[str, tuple[bool, bool]]] = field(default_factory=dict)
    returns: dict[str, list[tuple[bool, bool]]] = field(default_factory=dict)
    violations: set[str] = field(default_factory=set)
    nodes: dict[str, list[ast.AST]] = field(default_factory=dict)

    def run(self) -> list[str]:
        for _ in range(20):
            before = (repr(self.params), repr(self.returns))
            for name, fn in self.functions.items():
                self._function(name, fn)
            if (repr(self.params), repr(self.returns)) == before:
                return sorted(self.violations)
        raise AssertionError("the addressing analysis did not reach a fixed point")

    def _function(self, name: str, fn: ast.FunctionDef) -> None:
        env: dict[str, tuple[bool, bool]] = {p: s for p, s in self.params.get(name, {}).items()}
        nodes = self.nodes.setdefault(name, list(ast.walk(fn)))
        for _ in range(3):  # flow-insensitive: every assignment joined in, loops included
            for node in nodes:
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        self._assign(target, node.value, env, name)
                elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                    value = ast.BinOp(left=node.target, op=node.op, right=node.value)
                    ast.copy_location(value, node)
                    self._assign(node.target, value, env, name)
                elif isinstance(node, ast.For) and isinstance(node.target, ast.Name):
                    env[node.target.id] = _join(env.get(node.target.id), self._eval(node.iter, env, name))
                elif isinstance(node, (ast.Expr, ast.If, ast.While)):  # tl.store(...), tl.load(...), conditions
                    self._eval(node.value if isinstance(node, ast.Expr) else node.test, env, name)
                elif isinstance(node, ast.Return) and node.value is not None:
                    values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                    states = [self._eval(v, env, name) for v in values]
                    old = self.returns.get(name)
                    self.returns[name] = (
                        states if old is None or len(old) != len(states) else [_join(a, b) for a, b in zip(old, states)]
                    )

    def _assign(self, target: ast.expr, value: ast.expr, env: dict, fn: str) -> None:
        if isinstance(target, ast.Tuple):
            if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
                states = [self._eval(v, env, fn) for v in value.elts]
            else:
                whole = self._eval(value, env, fn)
                callee = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
                states = self.returns.get(callee) if callee in self.functions else None
                if not states or len(states) != len(target.elts):
                    states = [whole] * len(target.elts)
            for t, s in zip(target.elts, states):
                if isinstance(t, ast.Name):
                    env[t.id] = _join(env.get(t.id), s)
        elif isinstance(target, ast.Name):
            env[target.id] = _join(env.get(target.id), self._eval(value, env, fn))

    def _eval(self, node: ast.expr, env: dict, fn: str) -> tuple[bool, bool]:
        if isinstance(node, ast.Name):
            return env.get(node.id, (False, False))  # (grid-derived, int64)
        if isinstance(node, ast.Subscript):
            return self._eval(node.value, env, fn)
        if isinstance(node, ast.UnaryOp):
            return self._eval(node.operand, env, fn)
        if isinstance(node, ast.IfExp):
            return _join(self._eval(node.body, env, fn), self._eval(node.orelse, env, fn))
        if isinstance(node, ast.BinOp):
            left, right = self._eval(node.left, env, fn), self._eval(node.right, env, fn)
            if isinstance(node.op, ast.Mult):
                for stride, s_state, o_state in ((node.left, left, right), (node.right, right, left)):
                    if _is_stride(stride) and o_state[0] and not o_state[1] and not s_state[1]:
                        self.violations.add(f"{fn}, line {node.lineno}: {ast.unparse(node)}")
            return left[0] or right[0], left[1] or right[1]
        if isinstance(node, ast.Call):
            return self._call(node, env, fn)
        return False, False

    def _call(self, node: ast.Call, env: dict, fn: str) -> tuple[bool, bool]:
        func = node.func
        args = [self._eval(a, env, fn) for a in node.args]
        kwargs = {k.arg: self._eval(k.value, env, fn) for k in node.keywords if k.arg}
        grid = any(a[0] for a in args) or any(k[0] for k in kwargs.values())
        if isinstance(func, ast.Attribute):
            if func.attr == "program_id":
                return True, False
            if func.attr == "to":
                base = self._eval(func.value, env, fn)
                return base[0], any(_is_int64(a) for a in node.args)
            if func.attr in ("zeros", "full", "arange", "zeros_like"):
                return False, any(_is_int64(a) for a in [*node.args, *(k.value for k in node.keywords)])
            if func.attr in ("where", "minimum", "maximum"):
                values = args[1:] if func.attr == "where" else args
                return any(v[0] for v in values), bool(values) and all(v[1] for v in values)
            return grid, False
        if isinstance(func, ast.Name) and func.id in self.functions:
            params = [a.arg for a in self.functions[func.id].args.args]
            bound = self.params.setdefault(func.id, {})
            for p, s in [*zip(params, args), *kwargs.items()]:
                bound[p] = _join(bound.get(p), s)
            states = self.returns.get(func.id)
            if not states:
                return False, False
            return any(s[0] for s in states), all(s[1] for s in states)
        return grid, False


def _functions(sources: dict[str, str]) -> dict[str, ast.FunctionDef]:
    functions: dict[str, ast.FunctionDef] = {}
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                functions.setdefault(node.name, node)  # helpers are looked up by name (imported ones included)
    return functions


def violations(sources: dict[str, str]) -> list[str]:
    """Per module source, the grid-derived int32 index x stride products of its jit functions."""
    found = []
    for module, source in sources.items():  # one analysis per module, with every module's helpers in scope
        local = _functions({module: source})
        helpers = {k: v for k, v in _functions(sources).items() if k not in local}
        found += [f"{module}: {v}" for v in Addressing({**helpers, **local}).run() if v.split(",")[0] in local]
    return sorted(set(found))


def test_kernels_promote_grid_indices_before_strides():
    sources = {p.name: p.read_text() for p in sorted(KERNELS.glob("*.py"))}
    assert sum(len(_functions({k: v})) for k, v in sources.items()) >= 30, "the kernels were not found"
    assert violations(sources) == [], "int32 grid index x stride (promote with .to(tl.int64) first)"


BAD = {
    "direct": """
        @triton.jit
        def k(x_ptr, stride_x):
            row = tl.program_id(0)
            tl.load(x_ptr + row * stride_x)
        """,
    "through a block of rows": """
        @triton.jit
        def k(x_ptr, stride_x, BLOCK_T: tl.constexpr):
            rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
            tl.load(x_ptr + rows[:, None] * stride_x)
        """,
    "through a helper's parameter": """
        @triton.jit
        def helper(x_ptr, offs, stride_x):
            return tl.load(x_ptr + offs[:, None] * stride_x)

        @triton.jit
        def k(x_ptr, stride_x):
            offs = tl.program_id(0) * 16 + tl.arange(0, 16)
            helper(x_ptr, offs, stride_x)
        """,
    "through a helper's returned tuple": """
        @triton.jit
        def ids():
            return tl.program_id(0), tl.program_id(1)

        @triton.jit
        def k(x_ptr, stride_x):
            a, b = ids()
            tl.load(x_ptr + b * stride_x)
        """,
    "through a loaded index": """
        @triton.jit
        def k(x_ptr, idx_ptr, stride_x):
            i = tl.load(idx_ptr + tl.program_id(0))
            tl.load(x_ptr + i * stride_x)
        """,
    "int64 on one assignment only": """
        @triton.jit
        def k(x_ptr, stride_x, FLAG: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            if FLAG:
                row = tl.program_id(1)
            tl.load(x_ptr + row * stride_x)
        """,
}
GOOD = {
    "promoted first": """
        @triton.jit
        def k(x_ptr, stride_x, BLOCK_T: tl.constexpr):
            rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
            tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x)
        """,
    "promoted in a helper's return": """
        @triton.jit
        def row_of(t, H):
            return t.to(tl.int64) * H

        @triton.jit
        def k(x_ptr, stride_x, H):
            tl.load(x_ptr + (row_of(tl.program_id(0), H) + 1) * stride_x)
        """,
    "no grid index": """
        @triton.jit
        def k(x_ptr, stride_x, n):
            for i in range(0, n):
                tl.load(x_ptr + i * stride_x)
        """,
}


def test_addressing_analysis_catches_int32_products():
    """The check can fail: each bad kernel is flagged, each good one is not."""
    for name, source in BAD.items():
        assert violations({"bad.py": textwrap.dedent(source)}), f"not flagged: {name}"
    for name, source in GOOD.items():
        assert violations({"good.py": textwrap.dedent(source)}) == [], f"flagged: {name}"
