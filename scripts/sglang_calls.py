"""Every call ringrl makes into SGLang, checked against the source of the SGLang version requirements-gpu.txt
pins, read with ast (never imported: sglang's imports want CUDA), so no GPU and no sglang install are needed.

    python -m scripts.sglang_calls                    # the pinned version: the installed sglang if it is that
                                                      # version, else `pip download --no-deps` into
                                                        .sglang_source/
    python -m scripts.sglang_calls --version 0.5.23   # another version, the same way
    python -m scripts.sglang_calls --source DIR       # an unpacked sglang (DIR holds sglang/, or is it)

Prints a line per call: `ok`, `MISSING` (sglang lacks the name, a keyword, or the parameters in ringrl's
order), or `UNCHECKED` (ringrl's code went where this script cannot follow it); then
`sglang <version>: N calls, M ok`. Exits 0 only when every line is ok, 2 when no sglang source can be had.

The calls come from ringrl's source: every .py file outside tests/ that imports sglang. Values are followed
from those imports: a name imported from sglang is a symbol, and a call to it is checked (a class called gives
an instance); `self.x = <instance>` types `self.x` in the whole class, a local assignment types the local, and
a method called on an instance is looked up in the class's source, its own body then its bases'. ast cannot
see what sglang's calls return, so small tables say the rest:

- ATTRIBUTES: the class of an attribute ringrl reads off an sglang object (None: not sglang's, as the asyncio
  loop).
- POSITIONAL: for each call with positional arguments, the parameters ringrl means, in order: a signature that
  reorders them fails even where the count still fits.
- FORWARDS: keywords sglang passes on (`Engine(**kwargs)` builds `ServerArgs(**kwargs)`); DICTS: the ringrl
  functions whose returned dict literal is a class's keywords (`sampling_params()`: SamplingParams).

The tables cannot go stale in silence: each of these is an UNCHECKED line, which fails the run. An attribute
or a method used on an sglang value whose class nothing gives (an attribute ATTRIBUTES does not type, what an
sglang call returned); a positional call POSITIONAL does not list, or lists at another length; an sglang
object returned, passed to a call that is not sglang's, or stored anywhere but on `self` or in a local, where
it would drop out of view; a table entry nothing in ringrl uses. Out of view: a keyword dict that DICTS does
not name.
Also checked: the sglang classes built in a function that calls `MultiprocessingSerializer.serialize` travel
in its payload, so the SafeUnpickler next to the serializer must admit each.
"""
import argparse
import ast
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".sglang_source")  # git-ignored: <version>/src, the .py files of its wheel
SKIP = {"tests", "outputs", "multirun", "wheels", "bench_out", "gpu_check_report", "__pycache__"}

ENGINE = "sglang.Engine"
MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
ATTRIBUTES = {f"{ENGINE}.tokenizer_manager": MANAGER, f"{ENGINE}.loop": None}
POSITIONAL = {
    f"{ENGINE}.update_weights_from_tensor": ("named_tensors",),
    f"{ENGINE}.init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size",
                                            "group_name"),
    f"{ENGINE}.update_weights_from_distributed": ("names", "dtypes", "shapes"),
    f"{MANAGER}.pause_generation": ("obj",),
    f"{MANAGER}.continue_generation": ("obj",),
    "sglang.srt.utils.MultiprocessingSerializer.serialize": ("obj",),
    "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata": ("name", "shape", "dtype", "start_idx",
                                                                     "end_idx", "numel"),
}
FORWARDS = {ENGINE: "sglang.srt.server_args.ServerArgs"}
DICTS = {"engines/sglang.py:sampling_params": "sglang.srt.sampling.sampling_params.SamplingParams"}
SERIALIZER = ".MultiprocessingSerializer.serialize"


class SourceError(Exception):
    """No sglang source to read: the message is the one line the user sees."""


# ---- sglang's source, read with ast ----

@dataclass(frozen=True)
class Found:
    kind: str  # module | class | function | value
    module: str
    node: ast.AST | None = None
    owner: "Found | None" = None  # a method's class


@dataclass
class Params:
    positional: list  # the parameters a positional argument fills, in order
    keywords: set
    required: list
    varargs: bool = False
    kwargs: bool = False


class Sglang:
    def __init__(self, folder: str):
        self.folder, self.trees = folder, {}  # folder: the package, .../sglang

    def tree(self, module: str):
        """(module's ast, is a package), or None; a folder without __init__.py is an empty namespace
        package."""
        if module not in self.trees:
            base = os.path.join(self.folder, *module.split(".")[1:])
            self.trees[module] = None
            for path, package in ((base + ".py", False), (os.path.join(base, "__init__.py"), True)):
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as f:
                        self.trees[module] = (ast.parse(f.read()), package)
                    break
            else:
                if os.path.isdir(base):
                    self.trees[module] = (ast.Module(body=[], type_ignores=[]), True)
        return self.trees[module]

    def resolve(self, path: str) -> Found | None:
        parts = path.split(".")
        i = next((i for i in range(len(parts), 0, -1) if self.tree(".".join(parts[:i]))), 0)
        found = Found("module", ".".join(parts[:i])) if i else None
        for name in parts[i:]:
            found = found and self.member(found, name)
        return found

    def member(self, found: Found, name: str) -> Found | None:
        if found.kind == "module":
            return self.in_module(found.module, name)
        return self.in_class(found, name) if found.kind == "class" else None

    def in_module(self, module: str, name: str, seen: set | None = None) -> Found | None:
        seen = set() if seen is None else seen
        if (module, name) in seen or not self.tree(module):
            return None
        seen.add((module, name))
        tree, package = self.tree(module)
        body = top_level(tree.body)
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Found("class" if isinstance(node, ast.ClassDef) else "function", module, node)
        for node in body:
            if isinstance(node, ast.ImportFrom):
                source = absolute(module, package, node)
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.resolve(f"{source}.{alias.name}")
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        return self.resolve(alias.name)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in assigned_names(node) and node.value:
                value = node.value
                lazy = isinstance(value, ast.Call) and ast.unparse(value.func).endswith("LazyImport")
                if lazy and all(isinstance(a, ast.Constant) for a in value.args[:2]) and len(value.args) >= 2:
                    return self.resolve(f"{value.args[0].value}.{value.args[1].value}")
                if isinstance(value, ast.Name):
                    return self.in_module(module, value.id, seen)
                return Found("value", module, node)
        if package and self.tree(f"{module}.{name}"):
            return Found("module", f"{module}.{name}")
        stars = [absolute(module, package, n) for n in body if isinstance(n, ast.ImportFrom)
                 and n.names[0].name == "*"]
        return next((f for f in (self.in_module(s, name, seen) for s in stars) if f), None)

    def bases(self, cls: Found) -> list[Found]:
        found = [self.in_module(cls.module, b.id) for b in cls.node.bases if isinstance(b, ast.Name)]
        return [f for f in found if f and f.kind == "class"]

    def in_class(self, cls: Found, name: str) -> Found | None:
        for node in cls.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Found("function", cls.module, node, cls)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in assigned_names(node):
                return Found("value", cls.module, node, cls)
        for node in ast.walk(cls.node):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and f"self.{name}" in assigned_names(node):
                return Found("value", cls.module, node, cls)
        return next((f for f in (self.in_class(b, name) for b in self.bases(cls)) if f), None)

    def fields(self, cls: Found) -> tuple[list, list, bool]:
        """A record's (fields in order, fields without a default, keyword-only): its bases' then its own;
        where its module rebuilds it from namespace classes (`X.__annotations__ = ...` and a list of classes,
        as sglang 0.5.2x's ServerArgs), theirs too."""
        decorators = [d for d in cls.node.decorator_list if isinstance(d, ast.Call)]
        header = cls.node.keywords + [k for d in decorators for k in d.keywords]
        kw_only = any(k.arg == "kw_only" and getattr(k.value, "value", None) is True for k in header)
        names, required, parts = [], [], [self.fields(b) for b in self.bases(cls)]
        tree, _ = self.tree(cls.module)
        if any(f"{cls.node.name}.__annotations__" in assigned_names(n) for n in tree.body
               if isinstance(n, ast.Assign)):
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple)):
                    found = [self.in_module(cls.module, e.id) if isinstance(e, ast.Name) else None
                             for e in node.value.elts]
                    if found and all(f and f.kind == "class" for f in found):
                        parts += [self.fields(f) for f in found]
        own = [n for n in cls.node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
               and "ClassVar" not in ast.unparse(n.annotation)]
        parts.append(([n.target.id for n in own], [n.target.id for n in own if n.value is None], False))
        for part_names, part_required, part_kw_only in parts:
            names += [n for n in part_names if n not in names]
            required += part_required
            kw_only = kw_only or part_kw_only
        return names, required, kw_only

    def params(self, found: Found, bound: bool) -> Params | None:
        """What a call to `found` takes: a function's parameters (less self where `bound`, less cls for a
        classmethod), a class's __init__'s, or a record's fields."""
        if found.kind == "class":
            init = self.in_class(found, "__init__")
            if init and init.kind == "function":
                return self.params(init, True)
            names, required, kw_only = self.fields(found)
            return Params([] if kw_only else names, set(names), required)
        if found.kind != "function":
            return None
        args = found.node.args
        decorators = {ast.unparse(d) for d in found.node.decorator_list}
        drop = (found.owner is not None and "staticmethod" not in decorators
                and (bound or "classmethod" in decorators))
        positional = [a.arg for a in args.posonlyargs + args.args][drop:]
        defaults = len(args.defaults)
        required = positional[:len(positional) - defaults] + [
            a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
        keywords = {a.arg for a in args.args + args.kwonlyargs} - {a.arg for a in args.posonlyargs}
        return Params(positional, keywords, required, args.vararg is not None, args.kwarg is not None)

    def admitted(self, module: str) -> set | None:
        """The (module, name) pairs SafeUnpickler next to the serializer in `module` admits; None: no such
        class."""
        found = self.in_module(module, "SafeUnpickler")
        if not found or found.kind != "class":
            return None
        return {(n.elts[0].value, n.elts[1].value) for n in ast.walk(found.node) if isinstance(n, ast.Tuple)
                and len(n.elts) == 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                             for e in n.elts)}


def top_level(body: list) -> list:
    """A module's statements, with those under a top-level if/try (guarded imports and definitions)."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            out += top_level(node.body + node.orelse + getattr(node, "finalbody", []) +
                             [s for h in getattr(node, "handlers", []) for s in h.body])
    return out


def assigned_names(node) -> set:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {ast.unparse(t) for t in targets}


def absolute(module: str, package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    parts = module.split(".")[:len(module.split(".")) - (not package) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


# ---- ringrl's calls, followed from its sglang imports ----

SELF = "self"  # the type of a method's first parameter: `self.x` is looked up in the class's attributes


@dataclass(frozen=True)
class Use:
    kind: str  # import | call | method (on an instance) | attribute | pickled | unchecked
    # the sglang name as ringrl reaches it (sglang.Engine.async_generate); unchecked: what went wrong
    target: str
    positional: int = 0
    keywords: tuple = ()
    alternatives: tuple = ()  # an import's fallbacks under `except ImportError`: one of them must exist
    via: str = ""  # pickled: the serializer; a DICTS call: the ringrl function that builds the keywords


def split(value) -> tuple[str, str]:
    kind, _, path = (value if value and value != SELF else ":").partition(":")
    return kind, path


def escapes(value) -> bool:
    """An sglang object (not a module, a symbol or a call's result) that this script would lose track of."""
    return split(value)[0] in ("instance", "unknown")


def is_sglang(module: str | None) -> bool:
    return module is not None and (module == "sglang" or module.startswith("sglang."))


class Follower:
    """Follows sglang values through one ringrl file (the module docstring says how far)."""

    def __init__(self, sglang: Sglang):
        self.sglang, self.record, self.attrs, self.in_fallback = sglang, True, None, False
        self.lines: dict[Use, list[int]] = {}
        self.fallbacks, self.built, self.serializer = {}, [], None
        # what the tables' entries are used by
        self.read, self.positional, self.keyworded = set(), set(), set()

    def use(self, node, use: Use) -> None:
        if self.record:
            self.lines.setdefault(use, []).append(node.lineno)

    def unchecked(self, node, what: str) -> None:
        self.use(node, Use("unchecked", what))

    def module(self, tree: ast.Module) -> None:
        env = {}
        self.block([n for n in tree.body if not isinstance(n, ast.ClassDef)], env)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.attrs = {}
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                # `self.x` typed from every method before uses are recorded
                for record in (False, False, True):
                    self.record = record
                    for method in methods:
                        self.function(method, env, method=True)
                self.block([n for n in node.body if n not in methods], dict(env))
                self.attrs = None

    def function(self, node, env: dict, method: bool = False) -> None:
        env, args = dict(env), node.args
        names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
                 if a]
        env.update((name, None) for name in names)
        if method and args.posonlyargs + args.args and \
                "staticmethod" not in map(ast.unparse, node.decorator_list):
            env[names[0]] = SELF
        saved, self.built, self.serializer = (self.built, self.serializer), [], None
        self.block(node.body, env)
        for site, target in self.built if self.serializer else []:
            self.use(site, Use("pickled", target, via=self.serializer))
        self.built, self.serializer = saved

    def block(self, body: list, env: dict) -> None:
        for node in body:
            self.stmt(node, env)

    def walk(self, node, env: dict) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                self.stmt(child, env)
            elif isinstance(child, ast.expr):
                self.ev(child, env)
            else:
                self.walk(child, env)

    def stmt(self, node, env: dict) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self.imports(node, env)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.function(node, env)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = self.ev(node.value, env) if node.value else None
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                self.bind(target, value, env, node)
        elif isinstance(node, ast.Return) and escapes(self.ev(node.value, env) if node.value else None):
            self.unchecked(node, "ringrl returns an sglang object, out of this script's view")
        elif isinstance(node, ast.Try) and any(h.type is not None and re.search(
                r"\b(ImportError|ModuleNotFoundError)\b", ast.unparse(h.type)) for h in node.handlers):
            groups = {}
            for s in node.body + [s for h in node.handlers for s in h.body]:
                if isinstance(s, ast.ImportFrom) and is_sglang(s.module):
                    for a in s.names:
                        groups.setdefault(a.asname or a.name, []).append(f"{s.module}.{a.name}")
            for paths in groups.values():
                self.fallbacks.update((p, tuple(q for q in paths if q != p)) for p in paths)
            self.block(node.body, env)
            self.in_fallback = True
            for handler in node.handlers:
                self.block(handler.body, env)
            self.in_fallback = False
            self.block(node.orelse + node.finalbody, env)
        elif not isinstance(node, (ast.ClassDef, ast.Return)):
            self.walk(node, env)

    def imports(self, node, env: dict) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_sglang(alias.name):
                    self.use(node, Use("import", alias.name))
                    env[alias.asname or "sglang"] = f"module:{alias.name if alias.asname else 'sglang'}"
        elif is_sglang(node.module) and not node.level:
            for alias in node.names:
                path, name = f"{node.module}.{alias.name}", alias.asname or alias.name
                if alias.name == "*":
                    self.unchecked(node, f"from {node.module} import *: name what ringrl uses")
                    continue
                self.use(node, Use("import", path, alternatives=self.fallbacks.get(path, ())))
                if not (self.in_fallback and name in env):  # the names of the try body are the ones followed
                    env[name] = f"symbol:{path}"

    def bind(self, target, value, env: dict, node) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                env.get(target.value.id) == SELF:
            if value is not None or target.attr not in self.attrs:
                self.attrs[target.attr] = value
        else:
            self.walk(target, env)
            if escapes(value):
                self.unchecked(node, f"ringrl stores an sglang object in {ast.unparse(target)}, out of this "
                                     "script's view")

    def ev(self, node, env: dict):
        """The sglang type of an expression (None: not sglang's), recording the uses in it."""
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            return self.attribute(self.ev(node.value, env), node)
        if isinstance(node, ast.Call):
            return self.call(node, env)
        if isinstance(node, ast.Await):
            return self.ev(node.value, env)
        self.walk(node, env)
        return None

    def attribute(self, base, node: ast.Attribute):
        kind, path = split(base)
        if base == SELF:
            return self.attrs.get(node.attr)
        if kind in ("module", "symbol"):
            return f"symbol:{path}.{node.attr}"
        if kind == "instance":
            key = f"{path}.{node.attr}"
            self.use(node, Use("attribute", key))
            self.read.add(key)
            if key in ATTRIBUTES:
                return ATTRIBUTES[key] and f"instance:{ATTRIBUTES[key]}"
            return f"unknown:{key}"
        if kind == "unknown":
            self.unchecked(node, f"ringrl uses {node.attr} of {path}, whose class ATTRIBUTES does not give")
        elif kind == "result":
            self.unchecked(node, f"ringrl uses {node.attr} of what {path}() returns, which this script does "
                                 "not follow")
        return None

    def call(self, node: ast.Call, env: dict):
        func, target, bound = node.func, None, False
        name = node.args[1] if len(node.args) > 1 else None
        if isinstance(func, ast.Name) and func.id in ("hasattr", "getattr") and name and \
                escapes(self.ev(node.args[0], env)):
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                self.unchecked(node, f"ringrl calls {func.id} on an sglang object with a computed name")
                return None
            value = self.ev(ast.copy_location(ast.Attribute(node.args[0], name.value, ast.Load()), node), env)
            return value if func.id == "getattr" else None
        kind, path = split(self.ev(func.value, env) if isinstance(func, ast.Attribute)
                           else self.ev(func, env))
        if isinstance(func, ast.Attribute) and kind in ("instance", "module", "symbol"):
            target, bound = f"{path}.{func.attr}", kind == "instance"
        elif not isinstance(func, ast.Attribute) and kind == "symbol":
            target = path
        elif kind in ("instance", "unknown", "result"):
            self.unchecked(node, f"ringrl calls {ast.unparse(func)}, which this script cannot follow")
        values = [self.ev(a, env) for a in node.args] + [self.ev(k.value, env) for k in node.keywords]
        if target is None:
            if any(map(escapes, values)):
                self.unchecked(node, f"ringrl passes an sglang object to {ast.unparse(func)}, out of this "
                                     "script's view")
            return None
        keywords = tuple(k.arg for k in node.keywords if k.arg)
        if len(keywords) < len(node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            self.unchecked(node, f"ringrl unpacks arguments into {target}: pass them by name")
        self.use(node, Use("method" if bound else "call", target, len(node.args), keywords))
        if node.args:
            self.positional.add(target)
            if len(POSITIONAL.get(target, ())) != len(node.args):
                self.unchecked(node, f"ringrl passes {target} {len(node.args)} positional arguments: say in "
                                     "POSITIONAL which parameters they mean")
        if keywords:
            self.keyworded.add(target)
        if target.endswith(SERIALIZER):
            self.serializer = target
        found = self.sglang.resolve(target)
        if found and found.kind == "class" and not bound:
            self.built.append((node, target))
            return f"instance:{target}"
        return f"result:{target}"


def ringrl_files(root: str):
    """(path from root, ast) of every ringrl file outside tests/ that imports sglang."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP)
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            tree = ast.parse(text) if "sglang" in text else ast.Module(body=[])
            modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
                [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
            if any(map(is_sglang, modules)):
                yield os.path.relpath(path, root).replace(os.sep, "/"), tree


def collect(root: str, sglang: Sglang) -> dict[Use, list[tuple[str, int]]]:
    """Every use of sglang in ringrl's source under `root`, with its sites (file, line), and the table entries
    that no longer match that source as `unchecked` uses."""
    sites, read, positional, keyworded = {}, set(), set(), set()
    for rel, tree in ringrl_files(root):
        follower = Follower(sglang)
        follower.module(tree)
        for use, lines in follower.lines.items():
            sites.setdefault(use, []).extend((rel, n) for n in lines)
        read |= follower.read
        positional |= follower.positional
        keyworded |= follower.keyworded
    here = [("scripts/sglang_calls.py", 0)]
    for key, cls in DICTS.items():
        rel, function = key.split(":")
        path = os.path.join(root, rel)
        tree = ast.parse(open(path, encoding="utf-8").read()) if os.path.isfile(path) else ast.Module(body=[])
        returned = [n for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == function
                    for n in ast.walk(f) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)]
        if returned:
            keys = tuple(k.value for k in returned[0].value.keys if isinstance(k, ast.Constant))
            sites.setdefault(Use("call", cls, 0, keys, via=f"{function}()"), []).append(
                (rel, returned[0].lineno))
        else:
            sites[Use("unchecked", f"DICTS names {key}, which is gone or returns no dict literal")] = here
    for table, name, used in ((ATTRIBUTES, "ATTRIBUTES", read), (POSITIONAL, "POSITIONAL", positional),
                              (FORWARDS, "FORWARDS", keyworded)):
        for key in sorted(set(table) - used):
            sites[Use("unchecked", f"{name}[{key!r}]: nothing in ringrl uses it; remove the entry")] = here
    return sites


# ---- each use against sglang's source ----

def missing(sglang: Sglang, path: str) -> str:
    parts = path.split(".")
    i = next((i for i in range(len(parts) - 1, 0, -1) if sglang.resolve(".".join(parts[:i]))), 0)
    return f"{'.'.join(parts[:i])} has no {parts[i]}" if i else f"no {path}"


def check_call(sglang: Sglang, use: Use, p: Params) -> tuple[bool, str]:
    problems, note, n = [], "", use.positional
    if n > len(p.positional) and not p.varargs:
        problems.append(f"takes {len(p.positional)} positional arguments, ringrl passes {n}")
    meant = POSITIONAL.get(use.target, ())
    # else UNCHECKED already
    if len(meant) == n and len(p.positional) >= n and tuple(p.positional[:n]) != meant:
        problems.append(f"its first parameters are ({', '.join(p.positional[:n])}), ringrl means "
                        f"({', '.join(meant)})")
    unknown = [k for k in use.keywords if k not in p.keywords]
    required = [r for r in p.required if r not in p.positional[:n] and r not in use.keywords]
    if unknown and p.kwargs:
        forward = FORWARDS.get(use.target)
        found = forward and sglang.resolve(forward)
        fp = found and sglang.params(found, False)
        if fp:
            note = f"**kwargs go to {forward}"
            required += [r for r in fp.required if r not in use.keywords]
            unknown = [k for k in unknown if k not in fp.keywords]
        elif forward:
            problems.append(f"FORWARDS sends its **kwargs to {forward}: {missing(sglang, forward)}")
        else:
            note, unknown = f"takes **kwargs: {', '.join(unknown)} not checked", []
    if unknown:
        problems.append("no parameter " + ", ".join(unknown))
    if required:
        problems.append("needs " + ", ".join(required))
    return not problems, "; ".join(problems + [note] if note else problems)


def check(sglang: Sglang, use: Use) -> tuple[bool, str]:
    """(ok, what the line adds)."""
    if use.kind == "unchecked":
        return False, ""
    found = sglang.resolve(use.target)
    if use.kind == "import" and not found:
        other = next((a for a in use.alternatives if sglang.resolve(a)), None)
        return ((True, f"absent here; {other} is imported instead") if other
                else (False, missing(sglang, use.target)))
    if not found:
        return False, missing(sglang, use.target)
    if use.kind in ("import", "attribute"):
        return True, ""
    if use.kind == "pickled":
        serializer = sglang.resolve(use.via)
        admitted = serializer and sglang.admitted(serializer.module)
        if admitted is None:
            return True, "no SafeUnpickler next to the serializer: any class unpickles"
        name = (found.module, found.node.name)
        return name in admitted, ("SafeUnpickler admits it" if name in admitted
                                  else "SafeUnpickler does not admit it")
    params = sglang.params(found, use.kind == "method")
    return (check_call(sglang, use, params) if params
            else (True, f"a {found.kind}: its parameters are not checked"))


def describe(use: Use) -> str:
    if use.kind in ("import", "unchecked"):
        return f"import {use.target}" if use.kind == "import" else use.target
    if use.kind == "attribute":
        return f"{use.target} (attribute)"
    if use.kind == "pickled":
        return f"{use.target}, pickled by {use.via.split('.')[-2]}"
    if use.via:
        return f"{use.target}(**{use.via}: {', '.join(use.keywords)})"
    meant = (POSITIONAL.get(use.target, ()) + ("_",) * use.positional)[:use.positional]
    return f"{use.target}({', '.join(list(meant) + [f'{k}=' for k in use.keywords])})"


def check_all(folder: str, root: str = ROOT) -> list[tuple[bool, str]]:
    """One (ok, line) per use of sglang in ringrl's source under `root`, checked against the package in
    `folder`."""
    sglang, lines = Sglang(folder), []
    uses = collect(root, sglang)
    for use, where in sorted(uses.items(), key=lambda item: item[1][0]):
        ok, note = check(sglang, use)
        status = "UNCHECKED" if use.kind == "unchecked" else "ok" if ok else "MISSING"
        files = {}
        for rel, line in where:
            files.setdefault(rel, {})[str(line)] = None  # a dict: the lines in order, once each
        at = " ".join(f"{rel}:{','.join(lines)}".removesuffix(":0") for rel, lines in files.items())
        lines.append((ok, f"{status:<9} {describe(use)}{f' ({note})' if note else ''}  [{at}]"))
    return lines


# ---- where the source comes from ----

def pinned_version(root: str = ROOT) -> str:
    with open(os.path.join(root, "requirements-gpu.txt")) as f:
        for line in f:
            match = re.match(r"sglang==([\w.+-]+)", line.strip())
            if match:
                return match.group(1)
    raise SourceError("requirements-gpu.txt pins no sglang==<version>")


def package(folder: str) -> str | None:
    """The sglang package in `folder` (its sglang/, or itself), or None."""
    return next((p for p in (os.path.join(folder, "sglang"), folder)
                 if os.path.isdir(os.path.join(p, "srt"))), None)


def version_of(folder: str) -> str:
    for name in ("_version.py", "version.py"):
        path = os.path.join(folder, name)
        text = open(path).read() if os.path.isfile(path) else ""
        match = re.search(r"__version__[^\n=]*=[^'\"\n]*['\"]([^'\"]+)['\"]", text)
        if match:
            return match.group(1)
    infos = [n for n in os.listdir(os.path.dirname(folder)) if re.match(r"sglang-.+\.dist-info$", n)]
    return infos[0][len("sglang-"):-len(".dist-info")] if infos else "unknown"


def download(version: str, cache: str) -> str:
    """sglang `version`'s package, from the cache or `pip download --no-deps` (its .py files kept, not the
    archive)."""
    unpacked = os.path.join(cache, version, "src")
    if package(unpacked):
        return package(unpacked)
    archives = os.path.join(cache, version, "dist")
    os.makedirs(archives, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "-q", "-d",
               archives]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        error = result.returncode and (result.stderr.strip().splitlines() or ["pip failed"])[-1]
    except subprocess.TimeoutExpired:
        error = "no answer in 600 s"
    found = sorted(n for n in os.listdir(archives) if n.endswith(".whl"))  # sglang publishes wheels only
    if error or not found:
        shutil.rmtree(os.path.join(cache, version), ignore_errors=True)
        raise SourceError(f"no installed sglang {version}, and `pip download sglang=={version} --no-deps` "
                          f"failed: {error or 'no archive'}; pass --source DIR (an unpacked sglang)")
    partial, archive = unpacked + ".partial", os.path.join(archives, found[0])
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(archive) as z:
        z.extractall(partial, [n for n in z.namelist() if n.endswith(".py") or ".dist-info/" in n])
    os.replace(partial, unpacked)
    shutil.rmtree(archives)
    if not package(unpacked):
        raise SourceError(f"the sglang {version} wheel holds no sglang/srt/ package")
    return package(unpacked)


def find_source(version: str | None, source: str | None, cache: str = CACHE) -> tuple[str, str, str]:
    """(the sglang package folder, its version, where it came from)."""
    if source:
        folder = package(source)
        if not folder:
            raise SourceError(f"--source {source}: no sglang package there (a folder holding sglang/srt/)")
        return folder, version_of(folder), source
    wanted = version or pinned_version()
    spec = importlib.util.find_spec("sglang")  # locates the package without running its __init__
    if spec and spec.origin:
        try:
            if importlib.metadata.version("sglang") == wanted:
                return os.path.dirname(spec.origin), wanted, "the installed sglang"
        except importlib.metadata.PackageNotFoundError:
            pass
    folder = download(wanted, cache)
    return folder, wanted, f"pip download, unpacked in {os.path.relpath(folder, ROOT)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ringrl's calls into SGLang, checked against "
                                                 "SGLang's source.")
    parser.add_argument("--version", help="the sglang version to check (default: requirements-gpu.txt's pin)")
    parser.add_argument("--source",
                        help="an unpacked sglang (a folder holding sglang/srt/, or sglang/ itself)")
    args = parser.parse_args(argv)
    try:
        folder, version, origin = find_source(args.version, args.source)
    except SourceError as e:
        print(f"sglang_calls: {e}", file=sys.stderr)
        return 2
    print(f"sglang {version} from {origin}")
    lines = check_all(folder)
    for _, line in lines:
        print(line)
    good = sum(ok for ok, _ in lines)
    print(f"sglang {version}: {len(lines)} calls, {good} ok")
    return 0 if good == len(lines) else 1


if __name__ == "__main__":
    sys.exit(main())
