"""What the schema's source says about each key, beside its value: the field's comment and the ranges its
class's `check()` states through `registry.require`, read with ast and tokenize (`python train.py --help`:
launch/help.py).

A field's comment is the `# ...` on its line and the comment lines directly above it; a comment block ending
in ':' heads a run of fields instead (`# GPU plan only (...):`), and a block between two fields that both have
a comment on their own line goes on with the field above. A range is a `require(ok, key, message, got)` call's
key and message as a reader sees them: `f"must be in [0, train.lr={self.lr}]"` is "must be in [0, train.lr]".
"""
import ast
import dataclasses
import importlib
import inspect
import io
import itertools
import sys
import tokenize


@dataclasses.dataclass
class Notes:
    """What one class's source says: its docstring's first paragraph, each field's comment, the heading above
    a run of fields, and each `require` of its methods: key -> messages (a key its caller prefixes starts with
    "{}": RayNode's f"{where}.role" is "{}.role")."""
    doc: str = ""
    comments: dict[str, str] = dataclasses.field(default_factory=dict)
    headings: dict[str, str] = dataclasses.field(default_factory=dict)
    ranges: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def read_notes(source: str, scope: dict | None = None) -> dict[str, Notes]:
    """The Notes of each top-level class of a module's source, by class name. With `scope` (the module's
    globals) a message's value that reads only the module's names is filled in: `{', '.join(CORRECTIONS)}`."""
    own, trailing = {}, {}  # line -> comment text: comments alone on their line, and after code
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = not token.line[:token.start[1]].strip()
            (own if alone else trailing)[token.start[0]] = token.string.lstrip("#").strip()
    return {node.name: _class_notes(node, own, trailing, scope) for node in ast.parse(source).body
            if isinstance(node, ast.ClassDef)}


def _class_notes(node: ast.ClassDef, own: dict, trailing: dict, scope: dict | None) -> Notes:
    doc = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
    notes = Notes(doc=doc, ranges=_ranges(node, scope))
    previous = None  # the field just above: (name, its last line, whether it has a comment on its line)
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            previous = None
            continue
        name = stmt.target.id
        after = [trailing[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in trailing]
        above, line = [], stmt.lineno - 1
        while line in own:
            above.insert(0, own[line])
            line -= 1
        if above and above[-1].endswith(":"):
            notes.headings[name] = " ".join(above)
            above = []
        elif above and after and previous and previous[1] == line and previous[2]:
            notes.comments[previous[0]] += " " + " ".join(above)
            above = []
        if above or after:
            notes.comments[name] = " ".join(above + after)
        previous = (name, stmt.end_lineno, bool(after))
    return notes


def _ranges(node: ast.ClassDef, scope: dict | None) -> dict[str, list[str]]:
    """key -> the messages of the class's `require` calls; a call inside `for key in ("a", "b")` counts once
    for each."""
    loops: dict[int, dict[str, list[str]]] = {}  # a node inside such loops -> each loop's names
    for loop in ast.walk(node):
        if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and \
                isinstance(loop.iter, (ast.Tuple, ast.List)) and \
                all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in loop.iter.elts):
            for inner in ast.walk(loop):
                loops.setdefault(id(inner), {})[loop.target.id] = [e.value for e in loop.iter.elts]
    ranges: dict[str, list[str]] = {}
    for method in node.body:
        method_scope = isinstance(method, ast.FunctionDef) and scope is not None
        names = _imported(method, scope) if method_scope else None
        for call in ast.walk(method):
            if isinstance(call, ast.Call) and ast.unparse(call.func) in ("require", "registry.require") and \
                    len(call.args) >= 3:
                loop = loops.get(id(call), {})
                for values in itertools.product(*loop.values()):
                    bound = dict(zip(loop, values))
                    message = _text(call.args[2], bound, "…", names)
                    ranges.setdefault(_text(call.args[1], bound, "{}", None), []).append(message)
    return ranges


def _imported(method: ast.FunctionDef, scope: dict) -> dict:
    """The module's names and those the method imports itself (`from engines import ENGINES`)."""
    names = dict(scope)
    for node in ast.walk(method):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module = importlib.import_module(node.module)
            names.update({a.asname or a.name: getattr(module, a.name) for a in node.names
                          if hasattr(module, a.name)})
    return names


def _text(node: ast.expr, bound: dict, hole: str, names: dict | None) -> str:
    """A string expression as a reader sees it: an f-string's loop variables filled in, `train.lr={self.lr}`
    as `train.lr`, a value of the module's names computed, any other value as `hole`."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.Name) and node.id in bound:
        return bound[node.id]
    if isinstance(node, ast.JoinedStr):
        out = ""
        for part in node.values:
            if isinstance(part, ast.Constant):
                out += part.value
            elif isinstance(part.value, ast.Name) and part.value.id in bound:
                out += bound[part.value.id]
            elif out.endswith("="):
                out = out[:-1]
            else:
                out += _value(part.value, names) or hole
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left, bound, hole, names) + _text(node.right, bound, hole, names)
    if isinstance(node, ast.IfExp):  # `(f" times ..." if t.minibatches > 1 else "")`: the general case
        return _text(node.body, bound, hole, names)
    return hole


def _value(expr: ast.expr, names: dict | None) -> str:
    """An f-string's value where it reads only the module's names (not `self`, nor a local), else ""."""
    if names is None or any(isinstance(n, ast.Name) and n.id not in names for n in ast.walk(expr)):
        return ""
    try:  # the schema's own expressions, over its module's constants and registries
        return str(eval(compile(ast.Expression(expr), "<schema>", "eval"), dict(names)))
    except Exception:  # help shows "…" rather than fail on a message
        return ""


_READ: dict[str, dict[str, Notes]] = {}  # source file -> the Notes of its classes, each file read once


def notes_of(cls) -> list[Notes]:
    """The Notes of a dataclass and of each dataclass it inherits from, its own first."""
    out = []
    for c in cls.__mro__:
        if dataclasses.is_dataclass(c):
            path = inspect.getsourcefile(c)
            if path not in _READ:
                with open(path) as f:
                    _READ[path] = read_notes(f.read(), vars(sys.modules[c.__module__]))
            out.append(_READ[path].get(c.__name__, Notes()))
    return out
