"""The run file's JSON schema, generated: the sections from `run_file.RunFile` (pydantic), `[trainer.args]` from
RLConfig's fields (their TOML value kinds, defaults and other spellings). Editors read it (`#:schema` in a TOML
file, docs/configuration.md); `vf-rl` reads `[trainer.args]`'s part of it to check those keys before it imports
torch and transformers, so a typo or a wrong type is reported in well under two seconds.

`run_file.schema.json` is written by `python -m verifiers_rl.config.run_file` (`run_file.json_schema`);
tests/unit/test_config.py fails when it is stale.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("run_file.schema.json")
_NAMES = {int: "int", float: "float", bool: "bool", str: "str", list: "list", dict: "dict", type(None): "null"}


def kinds(annotation) -> list[str]:
    """The TOML value kinds a field accepts; ["any"] where the annotation is not plain data."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return sorted({kind for arg in typing.get_args(annotation) for kind in kinds(arg)})
    if origin is typing.Literal:
        return sorted({_NAMES.get(type(v), "any") for v in typing.get_args(annotation)})
    base = origin or annotation
    if base in _NAMES:
        return [_NAMES[base]]
    if isinstance(base, type) and issubclass(base, str):  # str-valued enums (IntervalStrategy, ...)
        return ["str"]
    return ["any"]


def _default(field: dataclasses.Field):
    value = field.default
    if value is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    if value is dataclasses.MISSING:
        return None
    if isinstance(value, str) or value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value):
        return list(value)
    if isinstance(value, dict):
        try:
            json.dumps(value)
            return value
        except TypeError:
            return None
    return getattr(value, "value", None)  # enums


_JSON = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "list": "array"}
_JSON.update({"dict": "object", "null": "null"})


def rlconfig_fields() -> dict[str, dict[str, Any]]:
    """{field: {kinds, default, toml}}: what a [trainer.args] key may hold, from RLConfig itself."""
    from verifiers_rl.config.rl_config import RLConfig

    hints = typing.get_type_hints(RLConfig)
    fields = {}
    for f in dataclasses.fields(RLConfig):
        if f.init:
            fields[f.name] = {"kinds": kinds(hints.get(f.name, Any)), "default": _default(f)}
            if f.metadata.get("toml"):  # the same setting's key outside [trainer.args]
                fields[f.name]["toml"] = f.metadata["toml"]
            if f.metadata.get("help"):
                fields[f.name]["help"] = " ".join(f.metadata["help"].split())
    return fields


def schema_property(entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"default": entry["default"]}
    if "any" not in entry["kinds"]:
        out["type"] = [_JSON[k] for k in entry["kinds"]]
    if entry.get("help"):
        out["description"] = entry["help"]
    if entry.get("toml"):
        out["x-toml"] = entry["toml"]
    return out


@functools.cache
def load_schema() -> dict[str, dict[str, Any]]:
    """[trainer.args]'s part of the generated schema, as {field: {kinds, default, toml}}."""
    kinds_of = {v: k for k, v in _JSON.items()}
    props = json.loads(SCHEMA_FILE.read_text())["$defs"]["Trainer"]["properties"]["args"]["properties"]
    out = {}
    for name, prop in props.items():
        entry = {
            "kinds": [kinds_of[t] for t in prop["type"]] if "type" in prop else ["any"],
            "default": prop["default"],
        }
        if "x-toml" in prop:
            entry["toml"] = prop["x-toml"]
        out[name] = entry
    return out


def _kind_of(value) -> str:
    if isinstance(value, bool):
        return "bool"
    for t, name in _NAMES.items():
        if t is not bool and isinstance(value, t):
            return name
    return "any"


def type_errors(args: dict[str, Any], schema: dict[str, dict[str, Any]]) -> list[str]:
    """`trainer.args.<key>=<value>: expected <kinds>` for every value of the wrong kind."""
    errors = []
    for key, value in args.items():
        if key not in schema:
            continue  # unknown keys are reported (with a suggestion) by toml_config
        kinds = schema[key]["kinds"]
        kind = _kind_of(value)
        ok = "any" in kinds or kind in kinds or (kind == "int" and "float" in kinds)
        if not ok:
            names = " or ".join(k if k != "null" else "none" for k in kinds)
            errors.append(f"trainer.args.{key}={value!r}: expected {names}")
    return errors


def rule_errors(args: dict[str, Any], schema: dict[str, dict[str, Any]]) -> list[str]:
    """RLConfig's own rules (config_checks) on the defaults overridden by `args`, without building it."""
    from verifiers_rl.config.checks import check_config, effective_sampling_args

    values = {k: v["default"] for k, v in schema.items()}
    values.update(args)
    values.setdefault("lora_config", None)
    cfg = SimpleNamespace(**values)
    try:
        effective_sampling_args(cfg, cfg.sampling_args)
    except ValueError as e:
        return [str(e).replace("invalid RLConfig: ", "trainer.args.")]
    return [f"trainer.args.{e}" for e in check_config(cfg)]
