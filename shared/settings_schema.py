"""Generic YAML-mapping → frozen-dataclass decoder, with errors that name the key path.

Role: the one mechanism every settings section is parsed by. A section is a frozen dataclass
whose fields carry a ``doc`` in their metadata (see :func:`setting`); the decoder walks the
type hints, so a section never writes parsing code of its own.

Invariants:
- an unknown key, a missing required key, or a value of the wrong type raises
  :class:`SettingsError` whose ``path`` is the full dotted/indexed key (``proxy.upstreams[1].url``);
- numbers are finite (``.inf`` and ``.nan`` are refused) and integers fit 64 bits, for every
  settings section and scenario alike;
- a section's own ``__post_init__`` checks raise :class:`SettingsError` with a path relative to
  that section; the decoder prefixes it, so the user still sees the full path;
- nothing here touches the file system: loading the YAML file lives in ``shared.settings``;
- a string value that is wholly an environment-variable reference (``os.environ/NAME``, as
  LiteLLM writes it, or ``${NAME}``) is replaced by that variable's value, here and only here,
  when the caller hands :func:`decode` an environment (the settings file loader does; the
  admin API does not, so a remote caller cannot read the proxy's environment); an unset
  variable is an error naming the key path and the variable.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

# Integers past 64 bits mean nothing in any setting, and numpy, DuckDB or the OS would fail on
# them later with a traceback instead of a key path.
INT_LIMIT = 2**63

# The two spellings of an environment-variable reference; the whole value must be one.
_ENV_REF = re.compile(r"os\.environ/([A-Za-z_][A-Za-z0-9_]*)|\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
ENV_HELP = (
    "Any string value (tokens and keys above all: proxy.admin_token, proxy.client_keys, "
    "proxy.upstreams[].api_key, rollout.local.admin_token) may be an environment-variable "
    "reference, os.environ/NAME or ${NAME}, resolved when the file is loaded; an unset "
    "variable is an error naming the key."
)


class SettingsError(ValueError):
    """A bad settings value; ``path`` names the key, ``str()`` reads ``path: message``."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def under(self, prefix: str) -> SettingsError:
        """The same error with ``prefix`` put in front of the path."""
        if not prefix:
            return self
        if not self.path:
            return SettingsError(prefix, self.message)
        joiner = "" if self.path.startswith("[") else "."
        return SettingsError(f"{prefix}{joiner}{self.path}", self.message)


def env_reference(value: str) -> str | None:
    """The variable ``value`` refers to when it is wholly ``os.environ/NAME`` or ``${NAME}``."""
    match = _ENV_REF.fullmatch(value)
    if match is None:
        return None
    return match.group(1) or match.group(2)


def resolve_env(value: str, env: Mapping[str, str] | None, path: str) -> str:
    """``value`` with an environment-variable reference replaced by the variable's value
    (``env`` None: taken literally); an unset variable raises naming ``path``."""
    if env is None:
        return value
    name = env_reference(value)
    if name is None:
        return value
    resolved = env.get(name)
    if resolved is None:
        raise SettingsError(path, f"environment variable {name} is not set")
    return resolved


def setting(default: Any = dataclasses.MISSING, *, doc: str, factory: Any = None) -> Any:
    """A documented dataclass field. ``doc`` is shown by ``scepsy-proxy --help-settings``."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def _short(value: Any) -> str:
    """``repr(value)``, cut short: an error message stays one readable line."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _decode(tp: Any, value: Any, path: str, env: Mapping[str, str] | None) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors: list[SettingsError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, value, path, env)
            except SettingsError as exc:
                errors.append(exc)
        raise (
            errors[0]
            if len(errors) == 1
            else SettingsError(
                path,
                f"expected one of {', '.join(_type_name(a) for a in args)}, got {_short(value)}",
            )
        )
    if origin is typing.Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise SettingsError(
                path, f"must be one of {', '.join(map(repr, allowed))}, got {_short(value)}"
            )
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise SettingsError(path, f"expected a list, got {type(value).__name__}")
        (item_tp, *_rest) = get_args(tp) or (Any,)
        return tuple(_decode(item_tp, item, f"{path}[{i}]", env) for i, item in enumerate(value))
    if origin is dict or origin is Mapping:
        if not isinstance(value, Mapping):
            raise SettingsError(path, f"expected a mapping, got {type(value).__name__}")
        key_tp, val_tp = get_args(tp) or (str, Any)
        return types.MappingProxyType(
            {
                _decode(key_tp, k, path, None): _decode(val_tp, v, _join(path, str(k)), env)
                for k, v in value.items()
            }
        )
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return decode(tp, value, path, env)
    if tp is bool:
        if not isinstance(value, bool):
            raise SettingsError(path, f"expected true or false, got {_short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(path, f"expected an integer, got {_short(value)}")
        if not -INT_LIMIT < value < INT_LIMIT:
            raise SettingsError(path, f"out of range (a 64-bit integer), got {_short(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SettingsError(path, f"expected a number, got {_short(value)}")
        if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:
            raise SettingsError(path, f"out of range, got {_short(value)}")
        if not math.isfinite(value):  # .inf, .nan: no setting or scenario figure means them
            raise SettingsError(path, f"must be a finite number, got {value}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SettingsError(path, f"expected a string, got {_short(value)}")
        return resolve_env(value, env, path)
    raise SettingsError(path, f"unsupported settings type {_type_name(tp)}")  # pragma: no cover


def decode(cls: type[T], data: Any, path: str = "", env: Mapping[str, str] | None = None) -> T:
    """Build the frozen dataclass ``cls`` from a YAML mapping, or raise a path-naming error.
    With ``env`` (``os.environ``), string values that reference a variable take its value."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise SettingsError(path, f"expected a mapping, got {type(data).__name__}")
    assert dataclasses.is_dataclass(cls)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        key = (
            unknown[0] if unknown[0].isprintable() and len(unknown[0]) <= 80 else _short(unknown[0])
        )
        raise SettingsError(_join(path, key), f"unknown key (known keys: {known})")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _decode(hints[name], data[name], _join(path, name), env)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SettingsError(_join(path, name), "required key is missing")
    try:
        return cls(**kwargs)
    except SettingsError as exc:
        raise exc.under(path) from None


def document(obj: Any) -> Any:
    """The plain mapping :func:`decode` builds ``obj`` back from (dataclasses → dicts, tuples
    → lists, mappings → dicts): a settings object as a YAML document, to overlay or to hand to
    another process. Values are already resolved: decode the result with ``env=None``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: document(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, tuple | list):
        return [document(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: document(v) for k, v in obj.items()}
    return obj


class SettingDoc(NamedTuple):
    """One row of ``--help-settings``."""

    key: str
    type: str
    default: str  # as it would be written in the YAML file; "(required)" when there is none
    doc: str


def _help_type(tp: Any) -> str:
    """A type as the YAML file sees it: ``list[str]``, ``a | b`` for a choice, ``int | null``."""
    origin = get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(map(str, get_args(tp)))
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _help_type(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        return f"list[{_help_type(args[0]) if args else 'any'}]"
    if origin is dict or origin is Mapping:
        key, val = get_args(tp) or (str, Any)
        return f"map[{_help_type(key)}, {_help_type(val)}]"
    if dataclasses.is_dataclass(tp):
        return "section"
    return _type_name(tp)


def _default_text(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return ""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, Mapping):
        return "{}" if not value else str(dict(value))
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


def describe(cls: type[Any], prefix: str = "") -> list[SettingDoc]:
    """(key path, type, default, doc) for every field of ``cls`` and its nested sections."""
    rows: list[SettingDoc] = []
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        key = _join(prefix, field.name)
        doc = str(field.metadata.get("doc", ""))
        rows.append(SettingDoc(key, _help_type(tp), _default_text(field), doc))
        inner = [
            a
            for a in (get_args(tp) or (tp,))
            if isinstance(a, type) and dataclasses.is_dataclass(a)
        ]
        for sub in inner:
            suffix = "[]" if get_origin(tp) in (list, tuple) else ""
            rows.extend(describe(sub, key + suffix))
    return rows
