"""Examples by name for `--example`, and the command line's options for an example's make_example."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import re
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from client.errors import ConfigError
from protocol.config import MODULE_NAME
from rollouts.env import Example


def example_names() -> list[str]:
    """The short names `--example` takes: the packages under examples/ that define make_example."""
    spec = importlib.util.find_spec("examples")  # found by name: the client does not import examples/
    names = []
    for info in pkgutil.iter_modules(spec.submodule_search_locations if spec else []):
        try:
            if info.ispkg and hasattr(importlib.import_module(f"examples.{info.name}"), "make_example"):
                names.append(info.name)
        except Exception:  # an example that cannot be imported here is not one to offer
            continue
    return sorted(names)


def load_example(name: str, /, **kwargs: Any) -> Example:
    """An example by short name (`demo`, `retail`) or by module path (`my_pkg.my_task`); the
    module must define `make_example(**kwargs) -> Example`."""
    module_name = name if "." in name else f"examples.{name}"

    def unknown() -> ConfigError:
        return ConfigError(f"--example {name!r}: no such example; the examples are {', '.join(example_names())}, "
                           f"or give the module path of your own that defines make_example()")

    if not re.match(MODULE_NAME, name):
        raise unknown()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the module asked for is unknown; a missing dependency inside it is its own error.
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise unknown() from None
        raise
    if not hasattr(module, "make_example"):
        raise ConfigError(f"--example {name!r}: module {module_name} defines no make_example()")
    accepted = inspect.signature(module.make_example).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    for key in kwargs:
        if not takes_any and key not in accepted:
            offered = [f"--{k.replace('_', '-')}" for k, p in accepted.items() if p.kind is p.KEYWORD_ONLY
                       or p.kind is p.POSITIONAL_OR_KEYWORD]
            raise ConfigError(f"--{key.replace('_', '-')}: no such option"
                              + (f"; --example {name} takes {', '.join(offered)}" if offered else
                                 f" (--example {name} takes none of its own)"))
    options = typed_options(module.make_example, kwargs)
    try:
        return module.make_example(**options)
    except TypeError as exc:  # make_example(**kwargs) passing them on to a constructor that refuses one
        refused = re.search(r"(unexpected|multiple values for) keyword argument '(\w+)'", str(exc))
        if kwargs and refused and refused.group(2) in kwargs:
            option = f"--{refused.group(2).replace('_', '-')}"
            raise ConfigError(f"{option}: no such option of --example {name}" if refused.group(1) == "unexpected"
                              else f"{option}: --example {name} sets it itself") from None
        raise
    except ValueError as exc:  # the example's own check of an option's value
        raise ConfigError(f"--example {name}: {exc}") from None


def typed_options(make_example: Any, options: dict[str, Any]) -> dict[str, Any]:
    """`options` as the example declares them, by make_example's parameters or, for the ones it
    passes on (`**kwargs`), by the fields of the dataclass it returns: the command line gives
    strings ("0.3", "8"). An option declared nowhere is passed as it is."""
    try:
        hints = typing.get_type_hints(make_example)
        made = hints.pop("return", None)
        declared = typing.get_type_hints(made) if dataclasses.is_dataclass(made) else {}
    except (NameError, TypeError):  # annotations that do not resolve: nothing to convert by
        return options
    params = inspect.signature(make_example).parameters
    declared.update({k: v for k, v in hints.items() if params[k].kind is not inspect.Parameter.VAR_KEYWORD})
    out = {}
    for key, value in options.items():
        if key not in declared:
            out[key] = value
            continue
        try:
            out[key] = TypeAdapter(declared[key]).validate_python(value)
        except ValidationError as exc:
            raise ConfigError(f"--{key.replace('_', '-')} {value!r}: {exc.errors()[0]['msg']}") from None
    return out


def example_options(args: list[str]) -> dict[str, Any]:
    """The command line's options that client.train does not know, for the example's make_example:
    `--name value` (repeated: a list), `--flag` alone: True. Dashes become underscores."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: options are --name value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = True  # type: ignore[assignment]
        key = key.replace("-", "_")
        if key in out:
            out[key] = (out[key] if isinstance(out[key], list) else [out[key]]) + [value]
        else:
            out[key] = value
        i += 1
    return out
