"""The run file: a `vf-rl` / `vf-train` / `vf-sft` TOML, read once into one typed object (`RunFile.read`).

    model = "Qwen/Qwen3-0.6B"            # hub id, local path, or "tiny" (built offline from [tiny])
    [env]       id = "reverse-text"      # + [env.args] for load_environment(**args); [[env]] + ratio: several
    [inference] gpus = 1                 # + engine, host, port, [inference.args] (vLLM flags)
    [trainer]   gpus = 1                 # + [trainer.args] (RLConfig fields), accelerate_config (ZeRO-3, FSDP2)
    [sft]       config = "configs/vf-sft/x.toml"   # ours: warm-start first (skipped when already done)
    [tiny]      hidden = 64, layers = 2, seed = 0  # ours: the offline tiny model
    [eval]      before = true, after = true        # ours: held-out eval around RL (+ base, greedy, temperature)

On its way in, the file's own spellings become ours (`toml.py`: command-line overrides, a Hosted Training
config's keys, the `[inference]` aliases of RLConfig fields); then pydantic checks every section and
`[trainer.args]` is checked against RLConfig's fields and rules without importing torch. What comes out is read by
attribute everywhere after; its errors are one line each that names the key and what is allowed.

pydantic, as prime-rl's configs use it: it is already in the dependency closure (verifiers), checks without
importing torch, and generates the JSON schema editors read (`python -m verifiers_rl.config.run_file`).
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from verifiers_rl.config import toml
from verifiers_rl.errors import ConfigError


class Section(BaseModel):
    # strict: a string is not a number, a number is not a boolean (a TOML user wrote what they meant)
    model_config = ConfigDict(extra="forbid", strict=True)


class Env(Section):
    id: str | None = Field(None, description="the environment to load (verifiers' load_environment)")
    args: dict[str, Any] = Field(default_factory=dict, description="load_environment's keyword arguments")
    ratio: int | float | None = Field(None, description="[[env]]: this environment's share of the prompts")


class Inference(Section):
    gpus: int = Field(1, ge=0, description="GPUs of the inference server (0: on the CPU)")
    # host, port, startup_timeout, engine and [inference.args] are RLConfig fields: folded into [trainer.args]


class Trainer(Section):
    gpus: int = Field(1, ge=0, description="GPUs of the trainer (0: on the CPU)")
    args: dict[str, Any] = Field(default_factory=dict, description="RLConfig fields (vf-sft: SFTConfig fields)")
    accelerate_config: str | None = Field(None, description="an accelerate config file: ZeRO-3, FSDP2, ...")


class Sft(Section):
    config: str = Field(description="a vf-sft config: its model is trained first and RL starts from it")


class Tiny(Section):
    """The offline tiny model; a key left out takes the model's own default (`verifiers_rl.tiny.TinySpec`, the one
    home of those defaults)."""

    hidden: int | None = None
    layers: int | None = None
    seed: int | None = None
    head_dim: int | None = None


class Eval(Section):
    before: bool = Field(False, description="evaluate on held-out prompts before RL")
    after: bool = Field(False, description="... and after")
    base: bool = Field(False, description="also the model the [sft] warm-start starts from")
    greedy: bool = Field(False, description="each evaluation also at temperature 0")
    temperature: int | float | None = None
    num_examples: int | None = None
    rollouts_per_example: int | None = None


class Dataset(Section):  # vf-sft
    env: str | None = None
    path: str | None = None
    name: str | None = None
    split: str = "train"
    completion_field: str = "answer"
    completion_template: str = "{answer}"
    replies: str | None = None
    num_examples: int | None = None


class RunFile(Section):
    model: str
    output_dir: str | None = None
    run_name: str | None = None
    env: list[Env] = Field(default_factory=list, description="[env], or one [[env]] table per environment")
    inference: Inference = Field(default_factory=Inference)
    trainer: Trainer = Field(default_factory=Trainer)
    sft: Sft | None = None
    tiny: Tiny = Field(default_factory=Tiny)
    eval: Eval = Field(default_factory=Eval)
    dataset: Dataset | None = None

    _path: str | None = PrivateAttr(None)
    _sft_file: RunFile | None = PrivateAttr(None)

    @classmethod
    def read(cls, path: str | Path, overrides: list[str] = (), command: str = "vf-rl") -> RunFile:
        """The TOML at `path` with the command line's `--section.key value` overrides, checked for `command`."""
        data, cli = toml.apply_overrides(toml.load(path), list(overrides))
        run = cls._checked(*toml.ours(data, cli, command), command)
        run._path = str(path)
        if run.sft is not None and command != "vf-sft":  # read here, once: the plan and the checks use it
            run._sft_file = cls.read(toml.resolve_path(run.sft.config, path), [], "vf-sft")
        return run

    @classmethod
    def parse(cls, data: dict[str, Any], overrides: list[str] = (), command: str = "vf-rl") -> RunFile:
        """A run file given as data (the TOML already loaded): checked as `read` checks a file."""
        data, cli = toml.apply_overrides(data, list(overrides))
        return cls._checked(*toml.ours(data, cli, command), command)

    @classmethod
    def _checked(cls, data: dict[str, Any], spelled: dict[str, str], several: bool, command: str) -> RunFile:
        try:
            run = cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError("; ".join(_messages(e, several))) from None
        run._check(command, several)
        if command != "vf-sft":
            check_trainer_args(run.trainer.args, spelled)
        return run

    @classmethod
    def from_plan(cls, data: dict[str, Any]) -> RunFile:
        """What vf-rl handed its trainer processes (`as_dict`): checked, not re-translated."""
        env = data.get("env")
        return cls.model_validate({**data, "env": [env] if isinstance(env, dict) else env})

    def _check(self, command: str, several: bool) -> None:
        if command == "vf-sft":
            if several:
                raise ConfigError("vf-sft takes one [env] (its [env.args] build the dataset), not [[env]] tables")
            return
        if not self.env or (not several and self.env[0].id is None):
            raise ConfigError("missing required key [env] id in the config")
        for i, entry in enumerate(self.env):
            if entry.id is None:
                raise ConfigError(f"env[{i}]: missing required key id (the environment to load)")
        if several:
            from verifiers_rl.config.checks import check_ratios

            try:
                check_ratios([1.0 if e.ratio is None else e.ratio for e in self.env], [e.id for e in self.env])
            except ValueError as e:
                raise ConfigError(str(e)) from None

    # --- what the rest of the program reads ---

    @property
    def path(self) -> str | None:
        """The file this was read from (paths in it are relative to it); None for a plan's copy."""
        return self._path

    @property
    def sft_file(self) -> RunFile | None:
        return self._sft_file

    def env_spec(self) -> Any:
        """The environment(s) as the file names them: one table, or a list of them with their ratios (what a
        checkpoint records, `run_settings.env_identity`)."""
        tables = [e.model_dump(exclude_defaults=True) for e in self.env]
        return tables[0] if len(tables) == 1 else tables

    def as_dict(self) -> dict[str, Any]:
        """The resolved config as data: printed by --dry-run, handed to the trainer processes, kept in the card."""
        out = self.model_dump(mode="json", exclude_none=True)
        out["env"] = self.env_spec()
        return out

    def resolve(self, value: str) -> str:
        """A path the file names, relative to the file (`toml.resolve_path`)."""
        return toml.resolve_path(value, self._path) if self._path else value

    def accelerate_config(self) -> str | None:
        path = self.trainer.accelerate_config
        return str(Path(self.resolve(path)).resolve()) if path else None

    def tiny_spec(self):
        """[tiny] over the tiny model's own defaults (imports torch); a spec it cannot build is one line naming it."""
        from verifiers_rl.tiny import TinySpec

        try:
            return TinySpec(**self.tiny.model_dump(exclude_none=True))
        except ValueError as e:
            raise ConfigError(f"[tiny] {e}") from None

    def output_dir_for(self, named: str | None, default: str) -> str:
        return toml.output_path(named, default, self._path)

    def rl_arguments(self, **overrides) -> dict[str, Any]:
        """The RLConfig keyword arguments the file gives, output_dir resolved against the file, before anything this
        process's hardware decides (`build_rl_config`): what vf-rl hands its trainer processes."""
        args = dict(self.trainer.args)
        run_name = self.run_name or args.get("run_name")
        args["output_dir"] = self.output_dir_for(args.get("output_dir") or self.output_dir, run_name or "vf-rl")
        if run_name:
            args.setdefault("run_name", run_name)
        return {**args, **overrides}

    def rl_config(self, cuda: bool | None = None, quiet: bool = False, **overrides):
        return build_rl_config(self.rl_arguments(**overrides), cuda, quiet)


def _messages(error: ValidationError, several: bool) -> list[str]:
    """pydantic's errors in our words: the key as the TOML spells it (`env[1].ratio`, `inference.gpus`), what was
    given and what is allowed. Errors inside a union name the field once."""
    out: list[str] = []
    for err in error.errors():
        key, field = _locate(err["loc"], several)
        given = err.get("input")
        kind = err["type"]
        if kind == "extra_forbidden":
            line = _unknown(key, isinstance(given, dict))
        elif kind == "missing":
            *section, name = key.split(".")
            line = f"missing required key {'[' + section[0] + '] ' if section else ''}{name} in the config"
        elif kind == "greater_than_equal":  # the only bound a section declares (gpus >= 0)
            line = f"{key}={given!r}: must be >= {err['ctx']['ge']}"
        elif kind.endswith("_type"):
            line = f"{key}={given!r}: expected {_expected(field)}"
        else:
            line = f"{key}={given!r}: {err['msg']}"
        if line not in out:
            out.append(line)
    return out


def _locate(loc: tuple, several: bool) -> tuple[str, Any]:
    """(the TOML key, its pydantic field) for an error location; what follows the field in `loc` (a union member's
    name) is dropped."""
    model: Any = RunFile
    key, field = "", None
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]" if several else ""
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            break
        key = f"{key}.{part}" if key else str(part)
        field = model.model_fields.get(part)
        if field is None:
            break
        model = _inner(field.annotation)
    return key, field


def _inner(annotation) -> Any:
    """The section model inside `list[Env]` or `Sft | None`, else the annotation."""
    for arg in typing.get_args(annotation) or ():
        inner = _inner(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


def _expected(field) -> str:
    from verifiers_rl.config.schema import kinds

    if field is None:
        return "another value"
    if _is_section(field):
        return "a table"
    order = ("int", "float", "bool", "str", "list", "dict")
    return " or ".join(sorted((k for k in kinds(field.annotation) if k != "null"), key=order.index))


def toml_keys() -> dict[str, list[str]]:
    """{section ("" for the top level): the keys it takes}, the other spellings of RLConfig fields included."""
    out = {"": [n for n, f in RunFile.model_fields.items() if not _is_section(f)]}
    out.update({n: list(_inner(f.annotation).model_fields) for n, f in RunFile.model_fields.items() if _is_section(f)})
    for alias in toml.aliases():
        section, key = alias.split(".")
        out[section] += [key] if key not in out[section] else []
    return out


def _unknown(key: str, table: bool) -> str:
    section, _, name = key.rpartition(".")
    keys = toml_keys()
    if not section and table:
        sections = [s for s in keys if s]
        return (
            f"unknown section [{name}]{toml.suggest(name, sections)}; allowed: {', '.join(f'[{s}]' for s in sections)}"
        )
    bare = section.split("[")[0]
    allowed = sorted(keys[bare])
    return f"unknown key {key!r}{toml.suggest(name, allowed)}; allowed in [{bare or 'top level'}]: {', '.join(allowed)}"


def _is_section(field) -> bool:
    inner = _inner(field.annotation)
    return isinstance(inner, type) and issubclass(inner, BaseModel)


def check_trainer_args(args: dict, spelled: dict[str, str] | None = None) -> None:
    """Keys, types and RLConfig's rules, from the generated schema: no torch or transformers import yet. `spelled`:
    fields the file wrote under another key ([inference] port), named that way in errors."""
    import warnings

    from verifiers_rl.config.legacy import translate_legacy_kwargs
    from verifiers_rl.config.schema import load_schema, rule_errors, type_errors

    schema = load_schema()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # RLConfig warns again when it is built
            args = translate_legacy_kwargs(args, "trainer.args")
    except ValueError as e:
        raise ConfigError(str(e).replace("invalid trainer.args: ", "trainer.args.")) from None
    for key in args:
        if key not in schema:
            raise ConfigError(
                f"unknown key 'trainer.args.{key}'{toml.suggest(key, schema)}; trainer.args takes RLConfig fields "
                "(see docs/configuration.md)"
            )
    errors = type_errors(args, schema) or rule_errors(args, schema)
    if errors:
        text = "; ".join(errors)
        for name, alias in (spelled or {}).items():
            text = text.replace(f"trainer.args.{name}=", f"{alias}=")
        raise ConfigError(text)


def build_rl_config(arguments: dict[str, Any], cuda: bool | None = None, quiet: bool = False):
    """RLConfig(**arguments) on this process's hardware. Without CUDA the trainer runs on the CPU: half-precision
    flags are dropped (with a notice) instead of failing, so one config serves a GPU box and a laptop."""
    from verifiers_rl.config.rl_config import RLConfig

    args = dict(arguments)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        dropped = [k for k in ("bf16", "fp16") if args.pop(k, False)]
        if dropped and not quiet:
            print(f"note: no CUDA device: training on CPU in float32 (ignoring {', '.join(dropped)})", file=sys.stderr)
        args["use_cpu"] = True
    import warnings

    from verifiers_rl.config.legacy import lora_without_lora

    if (unused := lora_without_lora(args)) and not quiet:
        print(f"note: use_lora = false (full fine-tuning): {unused} are ignored", file=sys.stderr)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "RLConfig: use_lora=False")  # said above, in the TOML's words
            return RLConfig(**args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[trainer.args] {e}") from None


def json_schema() -> dict[str, Any]:
    """RunFile's JSON schema, its [trainer.args] filled with RLConfig's fields and its sections with their
    fields' other spellings ([inference] port is trainer.args.vllm_server_port)."""
    from verifiers_rl.config.schema import rlconfig_fields, schema_property

    schema = RunFile.model_json_schema()
    defs = schema["$defs"]
    fields = {name: schema_property(entry) for name, entry in rlconfig_fields().items()}
    trainer_args = defs["Trainer"]["properties"]["args"]
    trainer_args.update(properties=fields, additionalProperties=False)
    for name, prop in fields.items():
        if "x-toml" in prop:
            section, key = prop["x-toml"].split(".")
            spelled = {**prop, "description": f"trainer.args.{name}"}
            if key == "args":  # a table of vLLM flags here, the command line they become there (`toml.flags_from_args`)
                spelled = {"type": "object", "description": f"vLLM's flags, as trainer.args.{name}"}
            defs[section.capitalize()]["properties"][key] = spelled
    defs["Trainer"]["properties"]["run_name"] = {"type": "string", "description": "the run's name (as run_name)"}
    env = schema["properties"]["env"]
    schema["properties"]["env"] = {"anyOf": [{"$ref": "#/$defs/Env"}, env], "description": env.get("description")}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def main() -> int:
    from verifiers_rl.config.schema import SCHEMA_FILE

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else SCHEMA_FILE
    out.write_text(json.dumps(json_schema(), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
