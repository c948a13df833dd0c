"""Where `Settings` values come from, and how their errors read (server/settings.py).

- `EnvSource`: `KVXFER_*` variables of a given environment. List settings also take
  comma lists (`KVXFER_NIXL__BACKENDS=UCX,GDS`), map settings `KEY=VALUE` lists
  (`KVXFER_NIXL__BACKEND_PARAMS=num_workers=2`); JSON (`["UCX"]`) is still read.
- `empty_entry`: the rule of every comma list, flag or variable: an empty entry
  (`a,,b`, `,a`, `a,`) is a typo and refused, except one trailing comma in a variable
  (`a,b,`, as templates emit), dropped before the entries are counted.
- `unknown_env_names`: `KVXFER_*` names no setting has, each with the closest valid one.
- `read_file`: the `--config` file, by extension: `.json`, `.toml`, `.yaml`/`.yml`; UTF-8,
  no key given twice in a mapping, every key a string, nothing nested past 32 levels.
- `cli_source`: the flags, on an argparse root with `--version`, readable metavars
  (`SECONDS`, `HOST:PORT`) and each default and variable named once; a list or map
  flag's empty entry is refused before pydantic-settings merges the values (it drops
  one from a map, and from a list after a repeated flag's first value).
- `problems`: a pydantic ValidationError as one (field, message) per failing field.

Everything here takes the settings class as an argument: it never imports it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliSettingsSource, EnvSettingsSource, SettingsError

from kvxfer._exceptions import InvalidInputError
from kvxfer._version import version

PREFIX = "KVXFER_"
DELIMITER = "__"
# Variables that are not sidecar settings: knobs of the test suite and the vLLM harness.
# A sidecar started by a test inherits them and must not refuse them.
NOT_SETTINGS = ("KVXFER_TEST_", "KVXFER_HARNESS_")
FILE_READERS = {".json": "JSON", ".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}
# Metavars the type alone does not tell (see _metavar for the rest).
_METAVARS = {
    "engine_address": "unix:PATH|HOST:PORT",
    "log_level": "LEVEL",
    "sidecar_id": "NAME",
    "backends": "NAME[,NAME...]",
    "allowed_peers": "CN[,CN...]",
    "backend_params": "KEY=VALUE[,KEY=VALUE...]",
}


def leaf_paths(model: type[BaseModel], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """("peer_address",), ("lease", "ttl_s"), ...: every setting, groups unfolded."""
    for name, field in model.model_fields.items():
        if _is_group(field.annotation):
            yield from leaf_paths(field.annotation, (*path, name))
        else:
            yield (*path, name)


def flag(path: tuple[str, ...]) -> str:
    return "--" + ".".join(p.replace("_", "-") for p in path)


def env_name(path: tuple[str, ...]) -> str:
    return PREFIX + DELIMITER.join(p.upper() for p in path)


def setting_name(path: tuple[str, ...]) -> str:
    """A setting as its errors name it: `lease.ttl_s (--lease.ttl-s, KVXFER_LEASE__TTL_S)`."""
    return f"{'.'.join(path)} ({flag(path)}, {env_name(path)})"


def _is_group(annotation: Any) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _field(model: type[BaseModel], path: tuple[str, ...]) -> FieldInfo | None:
    """The FieldInfo at `path`, or None where the path leaves the model."""
    field = None
    for name in path:
        if not _is_group(model) or name not in model.model_fields:
            return None
        field = model.model_fields[name]
        model = field.annotation  # type: ignore[assignment]
    return field


class _JsonNotTooDeep(EnvSettingsSource):
    """A flag's or variable's JSON nested past Python's recursion limit (`[[[[...`) is
    refused naming it: json.loads raised RecursionError, a traceback."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except RecursionError as exc:
            shown = flag if isinstance(self, CliSettingsSource) else env_name
            paths = {p[: i + 1] for p in leaf_paths(self.settings_cls) for i in range(len(p))}
            names = sorted(shown(p) for p in paths if p[-1] == field_name)
            raise InvalidInputError(
                " / ".join(names) or field_name, "its JSON is nested too deeply"
            ) from exc


class EnvSource(_JsonNotTooDeep):
    """`KVXFER_*` variables read from `environ` (not necessarily os.environ)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # Settings are case-insensitive (pydantic-settings' default): keys are lowered.
        return {k if self.case_sensitive else k.lower(): v for k, v in self._environ.items()}

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        text = value.strip() if isinstance(value, str) else None
        origin = typing.get_origin(field.annotation) if field is not None else None
        if text is None or text.startswith(("[", "{")) or origin not in (tuple, list, dict):
            return super().decode_complex_value(field_name, field, value)
        # Empty entries are kept, for the setting to refuse: `a,,b` is a typo, not `a,b`.
        # One trailing comma, as templates emit (`a,b,`), ends the list.
        items = [item.strip() for item in text.removesuffix(",").split(",")] if text else []
        if origin is not dict:
            return items
        problem = empty_entry(items) or _not_a_pair(items)
        if problem:
            names = [env_name(p) for p in leaf_paths(self.settings_cls) if p[-1] == field_name]
            raise InvalidInputError(" / ".join(names) or field_name, problem)
        pairs = (item.partition("=") for item in items)
        return {key.strip(): val.strip() for key, _, val in pairs}


def empty_entry(entries: Sequence[str]) -> str | None:
    """Why a comma list is refused if one of its entries is empty (`a,,b` is a typo,
    not `a,b`), else None. A variable's one trailing comma is dropped before this."""
    for index, entry in enumerate(entries):
        if not entry.strip():
            return f"entry {index + 1} of {len(entries)} is empty (a stray comma?)"
    return None


def _not_a_pair(entries: Sequence[str]) -> str | None:
    """Why a map's entries are refused if one is not KEY=VALUE, else None."""
    for entry in entries:
        key, sep, _ = entry.partition("=")
        if not sep or not key.strip():
            return f"expected KEY=VALUE[,KEY=VALUE...], got {entry!r}"
    return None


def _not_an_object(entries: Sequence[str]) -> str | None:
    """Why a map flag's JSON entries are refused if one is not an object, or is an empty
    one beside other entries (`a=1,{}` and `a=1,[]` added nothing, silently), else
    None; a lone `{}` is the empty map, as `[]` is. JSON that does not parse is refused
    as the flag's value is merged (`_CliSource`)."""
    for index, entry in enumerate(entries):
        if not entry.startswith(("{", "[")):
            continue
        try:
            value = json.loads(entry)
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict):
            return f"entry {index + 1} of {len(entries)} is not KEY=VALUE nor a JSON object"
        if not value and len(entries) > 1:
            return f"entry {index + 1} of {len(entries)} is an empty JSON object"
    return None


def unknown_env_names(model: type[BaseModel], environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name, message) for each `KVXFER_*` variable that names no setting."""
    leaves = [env_name(p) for p in leaf_paths(model)]
    groups = [env_name((n,)) for n, f in model.model_fields.items() if _is_group(f.annotation)]
    maps = [
        env_name(p) + DELIMITER
        for p in leaf_paths(model)
        if typing.get_origin(_annotation(model, p)) is dict
    ]
    found = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(PREFIX) or upper.startswith(NOT_SETTINGS):
            continue
        if upper in leaves or upper in groups or upper.startswith(tuple(maps)):
            continue
        close = difflib.get_close_matches(upper, leaves, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        found.append((name, f"no such setting{hint} (docs/configuration.md lists them)"))
    return found


def _annotation(model: type[BaseModel], path: tuple[str, ...]) -> Any:
    field = _field(model, path)
    return None if field is None else field.annotation


def read_file(path: Path) -> dict[str, Any]:
    """The settings in a `--config` file, read as its extension says."""
    kind = FILE_READERS.get(path.suffix.lower())
    if kind is None:
        known = ", ".join(FILE_READERS)
        raise InvalidInputError(
            "config", f"{str(path)!r}: unknown extension {path.suffix!r}; use one of {known}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInputError("config", f"cannot read {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        why = f"{exc.reason} at byte {exc.start}"
        raise InvalidInputError("config", f"{str(path)!r} is not UTF-8 text: {why}") from exc
    try:
        if kind == "YAML":
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
        elif kind == "TOML":
            data = tomllib.loads(text)  # refuses a key given twice itself
        else:
            data = json.loads(text, object_pairs_hook=_unique_keys)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        why = " ".join(str(exc).split())
        raise InvalidInputError("config", f"{str(path)!r} is not valid {kind}: {why}") from exc
    except _KeyTwiceError as exc:
        raise InvalidInputError("config", f"{str(path)!r} {exc}") from exc
    except RecursionError as exc:  # each parser recurses once per level
        raise InvalidInputError("config", f"{str(path)!r} is {_TOO_DEEP}") from exc
    if not isinstance(data, dict):
        raise InvalidInputError("config", f"{str(path)!r} must hold an object (a mapping)")
    problem = _not_settings(data)
    if problem:
        raise InvalidInputError("config", f"{str(path)!r} {problem}")
    return data


class _KeyTwiceError(Exception):
    """A mapping of a config file gives a key twice; read_file names the file."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, unless it gives a key twice: json.loads keeps the last one
    silently, even of a whole group (`"lease"` twice drops the first one's settings)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _KeyTwiceError(f"gives the key {key!r} twice in one object")
        found[key] = value
    return found


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice: it keeps the last
    one silently, as json.loads does. Keys merged in (`<<: *base`) may still be set
    again: that is what a merge is for."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[tuple[type, Any], yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = first.setdefault((type(key), key), key_node)  # 1 and true differ
            except TypeError:  # an unhashable key: super() refuses it
                continue
            if seen is not key_node:
                lines = f"lines {seen.start_mark.line + 1} and {key_node.start_mark.line + 1}"
                raise _KeyTwiceError(f"gives the key {key!r} twice in one mapping ({lines})")
        return super().construct_mapping(node, deep=deep)


# Far deeper than any setting (a group's list or map is 3 levels down), far shallower
# than Python's recursion limit, which the parsers and pydantic would reach.
_MAX_DEPTH = 32
_TOO_DEEP = f"nested more than {_MAX_DEPTH} levels deep"
# Far more than a file of settings holds (there are a few dozen settings), far fewer
# than the walk and pydantic take long over.
_MAX_VALUES = 100_000


def _not_settings(data: dict[Any, Any]) -> str | None:
    """Why a file that parsed cannot hold settings, to follow its name, else None: a key
    that is not a string (YAML reads an unquoted `1:`, `on:`, `~:` as a number, a
    boolean, null), nesting deeper than any setting, or more values than any file of
    settings holds. Walked in file order without recursion: a YAML alias of its own
    parent (`&a [*a]`) ends at the depth limit, aliases of aliases of ... (each used
    many times: billions of values in a few lines) at the count."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    count = 0
    while stack:
        count += 1
        if count > _MAX_VALUES:
            return (
                f"holds more than {_MAX_VALUES} values (a YAML alias counts each time it is used)"
            )
        value, where, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return f"is {_TOO_DEEP}"
        items: list[tuple[str, Any]] = []
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    return _key_problem(key, where)
                items.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            items = [(f"{where}[{index}]", item) for index, item in enumerate(value)]
        stack.extend((item, at, depth + 1) for at, item in reversed(items))
    return None


def _key_problem(key: object, where: str) -> str:
    place = f"in {where}" if where else "at the top level"
    hint = " (YAML reads an unquoted on, off, yes or no as one)" if isinstance(key, bool) else ""
    kinds = {bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    kind = kinds.get(type(key), f"a {type(key).__name__}")
    return f"has the key {key!r} {place}: {kind}, not a string{hint}; quote it"


def cli_source(settings_cls: type[BaseSettings], prog: str, epilog: str) -> CliSettingsSource[Any]:
    """The flags of `prog`: one per setting, plus `--version`."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(settings_cls.__doc__ or "").strip() or None,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --lease.ttl is not --lease.ttl-s
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    source: CliSettingsSource[Any] = _CliSource(settings_cls, root_parser=parser)
    for action in parser._actions:
        path = tuple(action.dest.split("."))
        field = _field(settings_cls, path)
        if field is None or _is_group(field.annotation) or not action.option_strings:
            continue
        if action.nargs != 0:  # boolean flags take no value
            action.metavar = _metavar(path[-1], field.annotation)
        action.help = _help(field, path)
    return source


class _CliSource(_JsonNotTooDeep, CliSettingsSource[Any]):
    """pydantic-settings' flags, with a list or map flag's empty entries refused.

    Its merge of a flag's values reads an empty entry as `""`, which a list keeps (for
    `_no_empty_entries` to refuse) but a map drops (`a=1,,b=2` was `{a: 1, b: 2}`), and
    after a repeated flag's first value it reads a leading comma or an empty value as
    nothing (`--nixl.backends UCX --nixl.backends ,GDS` was `UCX,GDS`). So each value
    is split here as it splits it and checked first; unlike a variable, a flag takes no
    trailing comma (nothing templates it). A map's entries must be KEY=VALUE too, as a
    variable's: its own error named no field ("not enough values to unpack").

    A refusal is kept in `refused` (dotted field, field as shown, why) and parsing goes
    on, so that the caller reports it beside every other field's problem.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.refused: list[tuple[str, str, str]] = []
        super().__init__(*args, **kwargs)

    def _merge_parsed_list(self, parsed_list: list[str], field_name: str) -> str:
        path = tuple(field_name.split("."))
        origin = typing.get_origin(_annotation(self.settings_cls, path))
        if origin in (tuple, list, dict):
            # A repeated flag is one list: `--x a, --x b` has entry 2 of 3 empty.
            entries = [e for value in parsed_list if isinstance(value, str) for e in _split(value)]
            problem = empty_entry(entries)
            if problem is None and origin is dict:
                # A JSON object (`{"k": "v"}`) is an entry pydantic-settings reads itself.
                problem = _not_a_pair([e for e in entries if not e.startswith(("{", "["))])
                problem = problem or _not_an_object(entries)
            if problem:
                return self._refuse(field_name, problem, origin)
        try:
            return super()._merge_parsed_list(parsed_list, field_name)
        except SettingsError as exc:  # JSON that does not parse (`--x '["a"'`)
            why = str(exc).removeprefix(f"Parsing error encountered for {field_name}: ")
            return self._refuse(field_name, f"not valid JSON: {why}", origin)

    def _refuse(self, field_name: str, problem: str, origin: Any) -> str:
        """Keep the refusal; the value parsing goes on with (none: no second error)."""
        path = tuple(field_name.split("."))
        shown = f"{field_name} ({flag(path)}, {env_name(path)})"
        self.refused.append((field_name, shown, problem))
        return "{}" if origin is dict else "[]"


def refused_flags(source: CliSettingsSource[Any]) -> list[tuple[str, str, str]]:
    """The list and map flags `source` refused as it parsed (`_CliSource`): (dotted
    field, field as shown, why)."""
    return list(source.refused) if isinstance(source, _CliSource) else []


def _split(value: str) -> list[str]:
    """One flag value's entries, split where pydantic-settings splits them: at each comma
    outside double quotes (`k="a,b"` is one entry) and outside an entry that is a JSON
    object or list; `[...]` around the whole value is dropped, so `[]` has none."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
        if not text.strip():
            return []
    entries, start, depth, quoted = [], 0, 0, False
    nested = text.lstrip().startswith(("{", "["))
    for index, char in enumerate(text):
        if char == '"' and text[index - 1 : index] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif nested and char in "{[":
            depth += 1
        elif nested and char in "}]":
            depth -= 1
        elif char == "," and depth <= 0:
            entries.append(text[start:index].strip())
            start, depth = index + 1, 0
            nested = text[start:].lstrip().startswith(("{", "["))
    entries.append(text[start:].strip())
    return entries


def _metavar(name: str, annotation: Any) -> str:
    if name in _METAVARS:
        return _METAVARS[name]
    args = set(typing.get_args(annotation)) or {annotation}
    if Path in args:
        return "FILE"
    if name.endswith("_address"):
        return "HOST:PORT"
    if name.endswith("_s"):
        return "SECONDS"
    if name.endswith("_bytes"):
        return "BYTES"
    if name.endswith("_rate"):
        return "FRACTION"
    if int in args:
        return "N"
    return "VALUE"


def _help(field: FieldInfo, path: tuple[str, ...]) -> str:
    value = field.get_default(call_default_factory=True)
    shown = ""
    if isinstance(value, tuple):
        shown = ",".join(value)
    elif isinstance(value, bool):
        shown = "on" if value else ""
    elif value is not None and not isinstance(value, dict):
        shown = str(value)
    default = f" (default: {shown})" if shown else ""
    text = f"{field.description or ''}{default} [{env_name(path)}]"
    return text.replace("%", "%%")


def problems(exc: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """One (field, message) per error; a leaf field is named with its flag and variable,
    an unknown key with the closest known one."""
    out = []
    for error in exc.errors():
        path = tuple(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        for named in (".".join(path), path[-1] if path else ""):  # check_address names it too
            message = message.removeprefix(f"{named}: ") if named else message
        if error["type"] == "extra_forbidden":
            known = [".".join(p) for p in leaf_paths(model)]
            close = difflib.get_close_matches(".".join(path), known, n=1, cutoff=0.6)
            message = "no such setting" + (f"; did you mean {close[0]}?" if close else "")
        elif _field(model, path) is not None and not _is_group(_annotation(model, path)):
            given = error.get("input")
            if isinstance(given, str | int | float) and "got" not in message:
                message += f", got {given!r}"
        if error["type"] == "string_type" and isinstance(error.get("input"), bool):
            message += " (YAML reads an unquoted on, off, yes or no as a boolean); quote it"
        name = ".".join(path) or "settings"
        if _field(model, path) is not None and not _is_group(_annotation(model, path)):
            name = setting_name(path)
        out.append((name, message))
    return out
