"""RLConfig's fields as data (name -> accepted TOML types and default), so `vf-rl` can check `[trainer.args]`
before it imports torch and transformers: a typo or a wrong type is reported in well under two seconds.

`rlconfig_schema.json` is generated from RLConfig (`python -m verifiers_rl.config.schema`);
tests/unit/test_docs.py fails when it is stale.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("rlconfig_schema.json")
_NAMES = {int: "int", float: "float", bool: "bool", str: "str", list: "list", dict: "dict", type(None): "null"}


def _kinds(annotation) -> list[str]:
    """The TOML value kinds a field accepts; ["any"] where the annotation is not plain data."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = []
        for arg in typing.get_args(annotation):
            kinds += _kinds(arg)
        return sorted(set(kinds))
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


def build_schema() -> dict[str, dict[str, Any]]:
    from verifiers_rl.config.rl_config import RLConfig

    hints = typing.get_type_hints(RLConfig)
    schema = {}
    for f in dataclasses.fields(RLConfig):
        if f.init:
            schema[f.name] = {"kinds": _kinds(hints.get(f.name, Any)), "default": _default(f)}
            if f.metadata.get("toml"):  # the same setting's key outside [trainer.args]
                schema[f.name]["toml"] = f.metadata["toml"]
    return schema


def load_schema() -> dict[str, dict[str, Any]]:
    return json.loads(SCHEMA_FILE.read_text())


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


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else SCHEMA_FILE
    out.write_text(json.dumps(build_schema(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
