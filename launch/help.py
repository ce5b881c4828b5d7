"""`python train.py --help [word ...] [group=option ...]` (or -h): every config key with its default, its
meaning and its allowed range, read from the schema (launch/schema_notes.py); train.py prints it before Hydra
sees the command line, and nothing starts.

A word keeps only the keys it names (`--help max_staleness`, `--help train`, else every key holding it);
`algo=tb`, `task=gsm8k`, ... list that rule's or task's own keys and what its preset changes.
"""
import dataclasses
import difflib
import inspect
import os
import re
import shutil
import sys
import textwrap

from omegaconf import OmegaConf

from launch.config import CONF_DIR, GROUPS, default_choices, options_of, preset_name
from launch.schema_notes import Notes, notes_of
from registry import unknown
from runtime.schema import Config

INTRO = ("python train.py [group=option ...] [key=value ...]: every key below with its default "
         "(runtime/schema.py), what it means and the values it takes; --help WORD lists only the keys "
         "holding WORD.")
PARTS = ("algo.* and task.* are the chosen rule's and task's own keys, from the Config dataclass of "
         "algos/<name>.py and tasks/<name>.py: below, algo={algo}'s and task={task}'s (python train.py "
         "--help algo=<name> task=<name> for others'). A chosen preset that changes a key says so after its "
         "meaning.")


@dataclasses.dataclass
class Row:
    key: str  # as typed on the command line: train.lora.rank
    value: object  # the schema's default
    meaning: str  # the field's comment
    heading: str  # a comment heading the run of fields this one starts
    ranges: list[str]  # its class's requires keyed "{}.<name>" (those naming the whole key: in Block.notes)


@dataclasses.dataclass
class Block:
    title: str  # the section: train, train.lora, ...
    about: str  # the section field's comment, and its class's docstring
    rows: list[Row]
    notes: list[Notes]  # of its class and bases


def blocks(obj, prefix: str = "", title: str = "top-level keys", about: str = "") -> list[Block]:
    """A dataclass instance's keys, then each section's inside it (a list of dataclasses: an item's)."""
    notes = notes_of(type(obj))
    rows, inner = [], []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        meaning = next((n.comments[f.name] for n in notes if f.name in n.comments), "")
        if dataclasses.is_dataclass(value):
            inner += blocks(value, key + ".", key, meaning)
            continue
        rows.append(Row(key, value, meaning, notes[0].headings.get(f.name, ""),
                        [m for n in notes for m in n.ranges.get("{}." + f.name, [])]))
        if value and isinstance(value, list) and all(dataclasses.is_dataclass(v) for v in value):
            inner += blocks(type(value[0])(), key + "[i].", key + "[i]", f"each item of {key}")
    doc = notes[0].doc
    about = f"{about}{'' if about.endswith('.') else '.'} {doc}" if about and doc else about or doc
    return [Block(title, about, rows, notes)] + inner


def _show(value) -> str:
    """A value as the command line writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or '""'
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_show, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _preset_values(choices: dict) -> dict[str, str]:
    """key -> which chosen preset changes it, and to what: "task=arithmetic sets -0.1" (the last one wins)."""
    out = {}
    for group, option in choices.items():
        path = os.path.join(CONF_DIR, group, f"{option}.yaml")
        data = (OmegaConf.to_container(OmegaConf.load(path)) or {}) if os.path.exists(path) else {}
        data.pop("defaults", None)
        out.update({key: f"{group}={option} sets {_show(value)}" for key, value in _leaves(data)})
    return out


def _selected(keys: list[str], words: list[str]) -> set[str]:
    """The keys each word names: the key or the section itself, else every key holding the word."""
    chosen = set()
    for word in words:
        found = {k for k in keys if k == word or k.startswith((word + ".", word + "["))} or \
            {k for k in keys if word in k}
        if not found:
            last = {k.rpartition(".")[2]: k for k in keys}  # `lrr` is near `train.lr` by its last part
            near = difflib.get_close_matches(word, list(keys) + list(last), n=1, cutoff=0.6)
            guess = f", did you mean '{last.get(near[0], near[0])}'?" if near else ""
            raise ValueError(f"no config key holds '{word}'{guess}")
        chosen |= found
    return chosen


def _row_lines(row: Row, ranges: list[str], preset: str, column: int, width: int) -> list[str]:
    """`  key = default    meaning (preset) [range]`, the meaning wrapped at `column`."""
    head = f"  {row.key} = {_show(row.value)}"
    ranges = [m if not re.match(r"\+ |[a-z_]+\.[\w.]+ ", m) else f"{row.key}{',' * m[0].isalpha()} {m}"
              for m in dict.fromkeys(ranges)]  # "+ cluster.trainer_ranks, ... must fit": the key starts it
    text = " ".join(filter(None, (row.meaning, f"({preset})" if preset else "",
                                  f"[{'; '.join(ranges)}]" if ranges else "")))
    lines = textwrap.wrap(row.heading, width, initial_indent="  ", subsequent_indent="  ")
    indent = " " * column
    if len(head) + 2 > column:  # a long default: its own lines, the meaning below it
        lines += textwrap.wrap(head, width, subsequent_indent=" " * 6, break_on_hyphens=False)
        return lines + textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent)
    return lines + (textwrap.wrap(text, width, initial_indent=head.ljust(column), subsequent_indent=indent)
                    or [head])


def _groups(choices: dict, groups, width: int) -> list[str]:
    """The options of each group, the chosen one starred."""
    lines = ["Groups (* chosen: the default run's unless the command line picks another):"] if groups else []
    for group in groups:
        names = ", ".join(o + "*" * (o == choices[group]) for o in options_of(group))
        lines += textwrap.wrap(names, width, initial_indent=f"  {group}=".ljust(11),
                               subsequent_indent=" " * 11)
    return lines


def render(args: list[str], width: int = 110) -> str:
    """The help for train.py's arguments but --help / -h: words to look for, group=option choices."""
    import algos
    import tasks

    choices = default_choices()
    for arg in args:
        group, _, option = arg.partition("=")
        if group in GROUPS and option:
            if option not in options_of(group):
                raise unknown(group, option, options_of(group))
            choices[group] = option
    words = [a for a in args if not a.startswith("-") and "=" not in a]
    parts = {g: m.get(preset_name(g, choices[g])) for g, m in (("algo", algos), ("task", tasks))}  # modules
    sections = blocks(Config(algo=parts["algo"].Config(), task=parts["task"].Config()))
    exact: dict[str, list[str]] = {}  # each require naming a whole key, in any class shown (Config's last)
    for notes in {id(n): n for b in sections[1:] + sections[:1] for n in b.notes}.values():
        for key, messages in notes.ranges.items():
            exact.setdefault(key, []).extend(messages)
    keep = _selected([r.key for b in sections for r in b.rows], words) if words else None
    presets = _preset_values(choices)
    out = _groups(choices, [w for w in words if w in GROUPS] if words else GROUPS, width)
    if not words:
        out = textwrap.wrap(INTRO, width) + [""] + out + textwrap.wrap(PARTS.format(**choices), width)
    for block in sections:
        rows = [r for r in block.rows if keep is None or r.key in keep]
        if not rows:
            continue
        title = block.title
        if title in parts:
            source = os.path.relpath(inspect.getsourcefile(parts[title]), os.path.dirname(CONF_DIR))
            title = f"{title} ({title}={choices[title]}: {source}'s Config)"
        out += [""] + textwrap.wrap(f"{title}: {block.about}" if block.about else title, width,
                                    subsequent_indent="  ")
        column = max((n for r in rows if (n := len(f"  {r.key} = {_show(r.value)}")) <= 40), default=20) + 3
        for row in rows:
            ranges = exact.get(row.key, []) + row.ranges
            out += _row_lines(row, ranges, presets.get(row.key, ""), column, width)
    return "\n".join(out).lstrip("\n")


def main(args: list[str]) -> int:
    """Print the help for train.py's command line; the exit code (2: a word or an option not there)."""
    width = max(60, min(shutil.get_terminal_size((110, 24)).columns, 110))
    try:
        text = render([a for a in args if a not in ("--help", "-h")], width)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
