"""The one parser of every command: `python -m hf_vla.<command> [CONFIG.json] [--key value ...]` into the command's
option dataclasses, with `--help` generated from their fields (see `CommandParser`)."""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_vla.errors import ConfigError

# ---- values against their fields' annotations (every command's options, before any weight or data is loaded) -------
# A string given where a number, boolean, list or dict is expected is decoded as JSON first, which is exactly what the
# command line does with `--key value`: `"learning_rate": "1e-3"` in a JSON file means 0.001, as `--learning_rate 1e-3`
# does, while `"max_steps": "abc"` is an error naming the key and the expected type.
_MISSING = object()


def _describe(annotation) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return f"one of {[m.value for m in annotation]}"
        return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
                list: "a list"}.get(annotation, annotation.__name__)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return f"a list of {_describe(item)}" if item is not Any else "a list"
    if origin is dict:
        return "an object"
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(annotation))}"
    return str(annotation)


def _convert(value, annotation):
    """`value` as `annotation` expects it, or _MISSING. Never coerces across kinds (no bool -> int, no str -> int)."""
    if annotation is Any or annotation is typing.Any:
        return value
    if annotation is type(None):
        return None if value is None else _MISSING
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            converted = _convert(value, option)
            if converted is not _MISSING:
                return converted
        return _MISSING
    if origin is typing.Literal:
        return value if value in typing.get_args(annotation) else _MISSING
    if origin is list or annotation is list:
        if not isinstance(value, list):
            return _MISSING
        (item,) = typing.get_args(annotation) or (Any,)
        items = [_convert(v, item) for v in value]
        return _MISSING if any(i is _MISSING for i in items) else items
    if origin is dict or annotation is dict:
        return value if isinstance(value, dict) else _MISSING
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            if isinstance(value, annotation):
                return value
            return value if value in {m.value for m in annotation} else _MISSING
        if annotation is bool:
            return value if isinstance(value, bool) else _MISSING
        if annotation is int:
            return value if isinstance(value, int) and not isinstance(value, bool) else _MISSING
        if annotation is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                return _MISSING
            return float(value)
        if annotation is str:
            return value if isinstance(value, str) else _MISSING
        return value if isinstance(value, annotation) else _MISSING
    return value  # an annotation we do not model: the dataclass validates it


def _suggest(unknown: list[str], known) -> str:
    import difflib

    hints = [f"{key!r} -> {match[0]!r}" for key in unknown
             if (match := difflib.get_close_matches(key, list(known), n=1, cutoff=0.75))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _accepts_str(annotation) -> bool:
    return _convert("", annotation) is not _MISSING or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType)
        and any(isinstance(a, type) and issubclass(a, enum.Enum) for a in typing.get_args(annotation))
    )


def check_value(key: str, value, annotation, where: str = ""):
    """`value` converted for a field annotated `annotation`; a ConfigError naming `where.key` otherwise."""
    converted = _convert(value, annotation)
    if converted is _MISSING and isinstance(value, str) and not _accepts_str(annotation):
        try:  # the command line's rule: a value is JSON when it parses
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = _MISSING
        if decoded is not _MISSING:
            converted = _convert(decoded, annotation)
    if converted is _MISSING:
        name = f"{where}.{key}" if where else key
        raise ConfigError(f"{name}: expected {_describe(annotation)}, got {value!r} ({type(value).__name__})")
    return converted


def field_annotations(dataclass_type) -> dict[str, Any]:
    hints = typing.get_type_hints(dataclass_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(dataclass_type) if f.init}


def check_fields(values: dict, dataclass_types, where: str = "") -> dict:
    """Type-check (and convert) every key of `values` against the fields of `dataclass_types`."""
    annotations = {}
    for dataclass_type in dataclass_types:
        annotations.update(field_annotations(dataclass_type))
    unknown = sorted(set(values) - set(annotations))
    if unknown:
        raise ConfigError(f"{where + ': ' if where else ''}unknown key(s) {unknown}{_suggest(unknown, annotations)}; "
                          f"known: {sorted(annotations)}")
    return {key: check_value(key, value, annotations[key], where) for key, value in values.items()}


def check_dataset_specs(specs: list, key: str = "datasets") -> list[dict]:
    """`specs` (the `datasets` of training, RL's `bc_datasets`) checked field by field against `DatasetConfig` without
    touching data: a `ConfigError` naming `key[index]` and the field; the specs with their values converted."""
    from hf_vla.data.dataset_config import DatasetConfig

    checked = []
    for index, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ConfigError(f"{key}[{index}] must be an object, got {spec!r}")
        spec = check_fields(spec, [DatasetConfig], where=f"{key}[{index}]")
        DatasetConfig(**spec)  # field-level validation (weights, cameras, names)
        checked.append(spec)
    return checked


def normalize_training_config(config: dict) -> None:
    """The values every training command (train, rl) reads its own way, rewritten in place before the type checks."""
    import os

    resume = config.get("resume_from_checkpoint")
    if isinstance(resume, bool) or str(resume).lower() in ("true", "false"):  # `--resume_from_checkpoint true`
        config["resume_from_checkpoint"] = "true" if resume in (True, "true", "True") else None
    deepspeed = config.get("deepspeed") or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed and config.get("dtype") == "bfloat16" and "bf16" not in config and not config.get("fp16"):
        # a bfloat16 model under DeepSpeed trains in its bf16 mode (fp32 master partitions); the DeepSpeed plugin
        # takes its precision when the training arguments are built, so it is set here
        config["bf16"] = True


def is_bool_field(annotation) -> bool:
    """True for `bool` and `bool | None` (the fields a bare `--flag` may set)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (
        annotation,)
    return bool in options and all(o in (bool, type(None)) for o in options)




@dataclass
class HelpStyle:
    """How a command speaks: whether `--help` exits (SystemExit(0)) or returns None, what an unknown key is called in
    its error (`what`), its `--help` sections (`sections(parser) -> [(title, fields, note)]`; default: one per
    dataclass, by field group) and whether each field's type is shown."""

    help_exits: bool = True
    what: str = "an argument"
    sections: Callable | None = None
    types_in_help: bool = True


class CommandParser:
    """The one parser of every command (train, rl, evaluate, record, serve, convert): an optional JSON config file,
    then `--key value` overrides, into the command's option dataclasses; `--help` is generated from their fields.

        python -m hf_vla.<command> [CONFIG.json] [--key value ...]

    The rules, the same for every command:
    - `--key value` or `--key=value`; a bare `--flag` sets a boolean field true; a list field takes every value up to
      the next flag (`--cameras a b`), or one JSON list; `null` is None.
    - A value is converted for its field's annotation (`hf_vla.training.config_checks`: JSON-decoded where the field
      takes no string: `--learning_rate 1e-3` is 0.001); a dotted key reaches into a dict or list field
      (`--model_config.chunk_size 10`, `--datasets.0.weight 2`), its value JSON-decoded when it parses.
    - Field metadata: `help`; `choices`; `min` (0: `>= 0`, 1: positive); `required`; `group` (the `--help` section).
    - `exclusive`: groups of fields at most one of which may be set (one of which must be, with `required_one`).
    Every error is a `ConfigError` naming the flag (or the file and key), before any model or data is loaded; the
    dataclasses' own `__post_init__` checks run last.
    """

    def __init__(self, prog: str, dataclass_types, description: str, config_file: str = "optional",
                 exclusive: tuple[tuple[str, ...], ...] = (), required_one: bool = False,
                 style: HelpStyle | None = None):
        if config_file not in ("none", "optional", "required"):
            raise ValueError(f"config_file={config_file!r}")
        self.prog, self.types, self.description = prog, tuple(dataclass_types), description
        self.config_file, self.exclusive, self.required_one = config_file, exclusive, required_one
        style = style or HelpStyle()
        self.help_exits, self.what, self.sections = style.help_exits, style.what, style.sections
        self.types_in_help = style.types_in_help
        self.annotations = {}
        self.fields = {}
        for kind in self.types:
            self.annotations.update(field_annotations(kind))
            self.fields.update({f.name: f for f in dataclasses.fields(kind) if f.init})

    # ------------------------------------------------------------------ parsing
    def parse(self, argv: list[str] | None = None):
        """The dataclass instances (one per type; the instance itself when there is one type), or None after
        printing `--help` (SystemExit(0) instead where `help_exits`)."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if any(a in ("-h", "--help") for a in argv) or (not argv and self.config_file == "required"):
            print(self.help_text())
            if self.help_exits:
                raise SystemExit(0)
            return None
        path = None
        if argv and not argv[0].startswith("--") and self.config_file != "none":
            path = Path(argv.pop(0))
        elif self.config_file == "required":
            raise ConfigError(f"the first argument must be a config file (a .json path), got {argv[0]!r}")
        return self.build(self.read(path, argv), str(path) if path else "command line")

    def parse_known(self, argv: list[str] | None = None) -> tuple:
        """(the dataclass instances, the `--key value` arguments of keys that are not their fields), for a command
        that passes the rest on (the demo gives them to the trainer); None for the instances after `--help`."""
        argv = list(sys.argv[1:] if argv is None else argv)
        own, rest = [], []
        target = own
        for token in argv:
            if token in ("-h", "--help"):
                target = own
            elif token.startswith("--"):
                name = token[2:].split("=", 1)[0].split(".", 1)[0].replace("-", "_")
                target = own if name in self.annotations else rest
            target.append(token)
        return self.parse(own), rest

    def read(self, path: Path | None, overrides: list[str]) -> dict:
        """The config file's keys (none without a file), each a field of the dataclasses, with the overrides applied
        on top: not yet type-checked (`build` does)."""
        config = read_config_file(path) if path is not None else {}
        _refuse_unknown(path, config, self.annotations, self.what)
        self.apply_overrides(config, overrides)
        return config

    def build(self, config: dict, source: str = "command line"):
        """`config` (field -> value) checked and turned into the dataclasses."""
        check_groups(config, [name for name, item in self.fields.items() if item.metadata.get("required")],
                     self.exclusive, self.required_one)
        config = check_fields(config, self.types)
        for name, value in config.items():
            check_metadata(name, value, self.fields[name].metadata)
        built = []
        for kind in self.types:
            names = {f.name for f in dataclasses.fields(kind)}
            try:
                built.append(kind(**{k: v for k, v in config.items() if k in names}))
            except ConfigError:
                raise
            except (ValueError, TypeError) as error:
                raise ConfigError(f"{source}: {error}") from error
        return built[0] if len(built) == 1 else tuple(built)

    def apply_overrides(self, config: dict, overrides: list[str]) -> None:
        """`--key value ...` into `config` (see the class's rules)."""
        apply_overrides(config, overrides, self.annotations, self.what, self.prog)

    # ------------------------------------------------------------------ help
    def help_text(self, width: int = 110) -> str:
        """The description, then every field with its type, default and help, by section."""
        import textwrap

        also = "" if self.config_file == "none" else " (and a key of a JSON config file given first)"
        config = {"none": "", "optional": " [CONFIG.json]", "required": " CONFIG.json"}[self.config_file]
        lines = [f"usage: {self.prog}{config} [--key VALUE ...]", "", self.description.strip(), "",
                 f"Every field below is a --key VALUE flag{also}."]
        for title, items, note in self.sections(self) if self.sections else self._default_sections():
            lines += ["", f"{title}:"]
            for item in items:
                default = field_default(item)
                annotation = self.annotations[item.name]
                kind = str(annotation) if typing.get_args(annotation) else getattr(annotation, "__name__", None)
                kind = (kind or str(annotation)).replace("typing.", "")
                kind = kind.replace("transformers.training_args.", "")
                shown = json.dumps(default) if default is None or isinstance(default, bool | list | dict) else default
                extra = note(item, default) if note else ""
                required = ", required" if item.metadata.get("required") else ""
                kind = f"{kind}{required}, " if self.types_in_help else ""
                lines.append(f"  --{item.name} ({kind}default: {shown}{extra})")
                text = " ".join(str(item.metadata.get("help") or "").split())
                if item.metadata.get("choices"):
                    text += f" [choices: {', '.join(map(str, item.metadata['choices']))}]"
                if text.strip():
                    lines += textwrap.wrap(text.strip(), width, initial_indent="      ", subsequent_indent="      ")
        lines += ["", "  --verbose   show library logs (FFmpeg, datasets, lerobot, DeepSpeed), hidden by default",
                  "  --help      this text"]
        return "\n".join(lines)

    def _default_sections(self):
        sections: dict[str, list] = {}
        for kind in self.types:
            for item in dataclasses.fields(kind):
                if item.init and not item.name.startswith("_"):
                    sections.setdefault(item.metadata.get("group") or "options", []).append(item)
        return [(title, items, None) for title, items in sections.items()]


def apply_overrides(config: dict, overrides: list[str], annotations: dict, what: str, prog: str) -> None:
    """`--key value ...` into `config` by the fields' `annotations` (see `CommandParser`'s rules)."""
    overrides = list(overrides)
    while overrides:
        flag = overrides.pop(0)
        if not flag.startswith("--"):
            raise ConfigError(f"override {flag!r}: expected --key value")
        key, value = flag[2:], None
        if "=" in key:
            key, value = key.split("=", 1)
        key = key.replace("-", "_")
        target, *path = key.split(".")
        if target not in annotations:  # a typo on the command line is the command line's
            raise _unknown_flag(key, target, annotations, what, prog)
        annotation = annotations[target]
        item = None if path else _list_item(annotation)  # a list field given whole takes several values
        if value is None:
            values = []
            while overrides and not overrides[0].startswith("--"):
                values.append(overrides.pop(0))
                if item is None:
                    break
            if item is not None:
                if len(values) == 1 and values[0].lstrip().startswith("["):
                    config[target] = _decode(values[0])
                else:  # none (a bare list flag) is the empty list
                    config[target] = [check_value(target, v, item) for v in values]
                continue
            if not values:
                if not is_bool_field(annotation):
                    raise ConfigError(f"--{key} needs a value (only boolean fields may be given as a bare flag)")
                values = ["true"]
            value = values[0]
        if path:
            _set_path(config, target, path, key, _decode(value))
        elif value == "null" or value.lstrip().startswith(("{", "[")):  # JSON null, objects and lists
            config[target] = _decode(value)
        else:  # converted for the field's type when checked (a string field keeps "5" a string)
            config[target] = value


def check_groups(config: dict, required: list[str], exclusive, required_one: bool) -> None:
    """The fields that must be set, and the groups of which at most (with `required_one`: exactly) one may be."""
    for group in exclusive:
        named = [name for name in group if config.get(name) is not None]
        if len(named) > 1:
            raise ConfigError(f"argument --{named[1]}: not allowed with argument --{named[0]}")
        if not named and required_one:
            raise ConfigError(f"one of the arguments {' '.join('--' + n for n in group)} is required")
    missing = [name for name in required if config.get(name) is None]
    if missing:
        raise ConfigError(f"the following arguments are required: {', '.join('--' + n for n in missing)}")


def check_metadata(name: str, value, metadata) -> None:
    """A checked value against its field's `choices` and `min`."""
    choices = metadata.get("choices")
    for item in (value if isinstance(value, list) else [value]) if choices else ():
        if item is not None and item not in choices:
            raise ConfigError(f"argument --{name}: invalid choice: {item!r} (choose from "
                              f"{', '.join(map(repr, choices))})")
    low = metadata.get("min")
    if low is not None and value is not None and not (value >= low if low == 0 else value > 0):
        raise ConfigError(f"--{name}={value}: must be {'>= 0' if low == 0 else 'positive'}")


def _refuse_unknown(path, config: dict, names, what: str) -> None:
    unknown = sorted(set(config) - set(names))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}{_suggest(unknown, names)} (not {what})")


def _unknown_flag(key: str, target: str, names, what: str, prog: str) -> ConfigError:
    return ConfigError(f"command line: --{key}: unknown argument{_suggest([target], names)} (not {what}; {prog} "
                       "--help lists them)")


# ---------------------------------------------------------------- answers before the heavy imports
# A command whose options include transformers' `TrainingArguments` (train, rl) cannot build its parser without
# importing transformers and torch (seconds of CPU). Its `--help` text and its key names are kept in
# hf_vla/templates/commands/<command>.json, written from the live parser (`python -m hf_vla --write-command-cache`;
# a test keeps them equal): `--help` and unknown keys answer from there, before anything heavy loads. Another
# transformers version than the one the file was written with uses the live parser.
CACHE_DIR = Path(__file__).parent / "templates" / "commands"


def _transformers_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def command_cache(command: str) -> dict | None:
    """The cached `--help` and key names of `command`, when written for the installed transformers."""
    path = CACHE_DIR / f"{command}.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cache if cache.get("transformers") == _transformers_version() else None


def command_cache_of(command: str, parser: CommandParser) -> dict:
    """What `write_command_cache` writes for `parser` (the live one): its `--help`, and every field's type (as
    `encode_annotation` writes it), choices, bound and whether it is required, so that a wrong type or value is
    refused from the cache too."""
    fields = {}
    for name in sorted(parser.annotations):
        metadata = parser.fields[name].metadata
        entry = {"type": encode_annotation(parser.annotations[name])}
        if metadata.get("choices"):
            entry["choices"] = list(metadata["choices"])
        if metadata.get("min") is not None:
            entry["min"] = metadata["min"]
        if metadata.get("required"):
            entry["required"] = True
        fields[name] = entry
    return {"command": command, "transformers": _transformers_version(), "prog": parser.prog, "what": parser.what,
            "exclusive": [list(group) for group in parser.exclusive], "required_one": parser.required_one,
            "fields": fields, "help": parser.help_text()}


def write_command_cache(command: str, parser: CommandParser) -> Path:
    path = CACHE_DIR / f"{command}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(command_cache_of(command, parser), indent=1) + "\n")
    return path


_SCALARS = {bool: "bool", int: "int", float: "float", str: "str", dict: "dict", list: "list", type(None): "null"}


def encode_annotation(annotation):
    """A field's annotation as JSON, for the types the checks model (scalars, lists, unions, literals, enums,
    objects); "any" for the rest, which only the live parser checks."""
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": [member.value for member in annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict:
        return "dict"
    if origin is list:
        return {"list": encode_annotation(args[0]) if args else "any"}
    if origin is typing.Literal:
        return {"literal": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [encode_annotation(a) for a in args]
        return "any" if "any" in options else {"union": options}
    return "any"


def decode_annotation(encoded):
    """`encode_annotation`'s inverse: an annotation `check_value` treats as it treats the original (an enum comes
    back as an enum of the same values)."""
    if isinstance(encoded, str):
        return {value: kind for kind, value in _SCALARS.items()}.get(encoded, typing.Any)
    (kind, value), = encoded.items()
    if kind == "enum":
        return enum.Enum("Choice", {f"m{i}": v for i, v in enumerate(value)})
    if kind == "list":
        return list[decode_annotation(value)]
    if kind == "literal":
        return typing.Literal[tuple(value)]
    return typing.Union[tuple(decode_annotation(v) for v in value)]  # noqa: UP007 (built from a list)


def answer_early(command: str, argv: list[str]) -> bool:
    """From the cache of `command` (a config file first, then `--key value` overrides): print `--help` (True), or
    raise the `ConfigError` the live parser would raise for a missing or unreadable config file, an unknown key, a
    missing required one, a wrong type, choice or bound, or a bad `datasets` entry; False when the live parser must
    look (the dataclasses' own checks, `model_config`), or there is no usable cache."""
    cache = command_cache(command)
    if cache is None:
        return False
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(cache["help"])
        return True
    if argv[0].startswith("--"):  # no config file: the command says so itself
        return False
    fields = cache["fields"]
    config = read_config_file(Path(argv[0]))
    _refuse_unknown(argv[0], config, fields, cache["what"])
    annotations = {name: decode_annotation(entry["type"]) for name, entry in fields.items()}
    apply_overrides(config, argv[1:], annotations, cache["what"], cache["prog"])
    normalize_training_config(config)
    check_groups(config, [name for name, entry in fields.items() if entry.get("required")],
                 [tuple(group) for group in cache["exclusive"]], cache["required_one"])
    for name, value in config.items():
        if annotations[name] is not typing.Any:
            check_metadata(name, check_value(name, value, annotations[name]), fields[name])
    for key in ("datasets", "bc_datasets"):
        if isinstance(config.get(key), list):
            check_dataset_specs(config[key], key)
    return False


def field_default(item: dataclasses.Field):
    """A field's default as a config writes it (an enum's value); `(required)` without one."""
    if item.default is not dataclasses.MISSING:
        value = item.default
    elif item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
    else:
        return "(required)"
    return getattr(value, "value", value)


def _list_item(annotation):
    """The item type of a `list[X]` or `list[X] | None` field (`typing.Any` for a bare `list`), else None."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (
        annotation,)
    options = [o for o in options if o is not type(None)]
    if len(options) != 1 or not (typing.get_origin(options[0]) is list or options[0] is list):
        return None
    return (typing.get_args(options[0]) or (typing.Any,))[0]


def _decode(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _index(node: list, part: str, key: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override --{key}: {where} is a list of {len(node)} entr{'y' if len(node) == 1 else 'ies'}; "
                          f"use an index 0..{len(node) - 1} (--{where}.0.<field> VALUE), or give the whole list")
    return int(part)


def _set_path(config: dict, target: str, path: list[str], key: str, value) -> None:
    """A dotted override into dicts (created when missing) and lists (by index: `datasets.0.cameras`)."""
    node = config.setdefault(target, [] if target == "datasets" else {})
    where = target
    for part in path[:-1]:
        if isinstance(node, list):
            child = node[_index(node, part, key, where)]
        elif isinstance(node, dict):
            child = node.setdefault(part, {})
        else:
            raise ConfigError(f"override --{key}: {where!r} is not an object")
        if not isinstance(child, dict | list):
            raise ConfigError(f"override --{key}: {where}.{part} is {child!r}, not an object or list")
        node, where = child, f"{where}.{part}"
    if isinstance(node, list):  # --datasets.0 '{...}': one whole entry
        node[_index(node, path[-1], key, where)] = value
    elif isinstance(node, dict):
        node[path[-1]] = value
    else:
        raise ConfigError(f"override --{key}: {where!r} is not an object")


def read_config_file(path: Path) -> dict:
    """A JSON config file as a dict (its free-form `//` comment dropped); one line naming the file otherwise."""
    from hf_vla.errors import MissingFileError

    if not path.is_file():
        raise MissingFileError(f"config file {path} not found")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:  # (not storage.read_json: a config's messages name the file first)
        raise ConfigError(f"{path}: not valid JSON ({error})") from error
    except UnicodeDecodeError as error:  # a binary file (a checkpoint, an image) given as the config
        raise ConfigError(f"{path}: not a JSON config file (not UTF-8 text: byte {error.start} is "
                          f"{error.object[error.start:error.start + 1]!r})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the configuration must be a JSON object, got {type(config).__name__}")
    config.pop("//", None)  # free-form comment key
    return config


__all__ = ["CommandParser", "field_default", "read_config_file"]
