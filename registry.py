"""How ringrl finds its parts by name, and how it refuses a name or a value: one style for losses, tasks,
rewards and engines, one message for each kind of mistake.

    LOSSES = Registry("algo", "algos", folder)         # a part is a module: algos/<name>.py
    LOSSES.names(); LOSSES.get("tb")                   # its module; an unknown name:
                                                         one line naming the valid ones
    require(lr > 0, "train.lr", "must be > 0", lr)      # a value out of range: one line naming the key

A new part is its file (and, for a task or a rule that sets other keys, its conf/<group>/<name>.yaml): nothing
lists the parts, so nothing else changes.
"""
import importlib
import os


class Registry:
    """The parts of one kind: every module of `package` (in `folder`) but those starting with `_` and the
    package's own `helpers`, by file name; imported only when asked for."""

    def __init__(self, kind: str, package: str, folder: str, helpers: tuple[str, ...] = ()):
        self.kind, self.package, self.folder, self.helpers = kind, package, folder, helpers

    def names(self) -> list[str]:
        return sorted(f[:-3] for f in os.listdir(self.folder)
                      if f.endswith(".py") and not f.startswith("_") and f[:-3] not in self.helpers)

    def get(self, name: str):
        """The module of part `name`."""
        if name not in self.names():
            raise unknown(self.kind, name, self.names())
        return importlib.import_module(f"{self.package}.{name}")


def unknown(kind: str, name: str, valid, hint: str = "") -> ValueError:
    """The one error for a name that is not there: `unknown algo 'x' (choose one of: a, b, c)`."""
    return ValueError(f"unknown {kind} '{name}' (choose one of: {', '.join(valid)}{hint})")


def require(ok: bool, key: str, what: str, got) -> None:
    """The one error for a value out of range: `config key 'train.lr' must be > 0 (got -1.0)`."""
    if not ok:
        raise ValueError(f"config key '{key}' {what} (got {got!r})")
