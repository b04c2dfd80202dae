"""`vf-train @ cfg.toml [--section.key value ...]`: the trainer only, against a server that already runs
(`vf-vllm`, or the one `vf-rl` started). Server address from [inference] host/port (or [trainer.args]
vllm_server_host/port; 8000 when unset); control token from $VF_CONTROL_TOKEN.

`-m verifiers_rl.scripts.train --from-plan`: the per-process entry point of the trainer `vf-rl` starts (under
`accelerate launch` when it has several processes). The config, the model and the RLConfig arguments come
resolved in vf-rl's plan ($VF_RUN_PLAN, `rl_plan.rank_inputs`); no config file is read.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from verifiers_rl.config.net import DEFAULT_PORT
from verifiers_rl.config.run_file import RunFile, build_rl_config
from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.run import PLAN_ENV, from_ranks_env
from verifiers_rl.scripts.common import load_env, resolve_model, run_cli, split_argv, train_and_evaluate
from verifiers_rl.scripts.rl_plan import FROM_PLAN, check_model


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point. It raises SystemExit(code) itself: verifiers' own `vf-*` scripts call `main()`
    and drop its return value, and whichever package was installed last owns the script name."""
    raise SystemExit(run_command(argv))


def run_command(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if argv == [FROM_PLAN]:
            return from_plan()
        path, overrides, flags = split_argv(argv, "vf-train")
        run = RunFile.read(path, overrides, "vf-train")
        if run.sft_file is not None:
            from verifiers_rl.scripts.sft import sft_plan

            model = sft_plan(run.sft_file).final_dir
        else:
            model = resolve_model(run)
            check_model(model, dry_run="--dry-run" in flags)
        args = run.rl_config(server_mode="connect")
        if "--dry-run" in flags:
            print(
                f"vf-train: would train {model} on {', '.join(e.id for e in run.env)} against "
                f"http://{args.vllm_server_host}:{args.vllm_server_port or DEFAULT_PORT} -> {args.output_dir}"
            )
            return 0
        return train_and_evaluate(model, load_env(run), args, run)

    return run_cli("vf-train", body)


def from_plan() -> int:
    """A trainer process vf-rl started: it trains with what vf-rl resolved and checked once (config, model, RLConfig
    arguments, the settings its memory fit chose); only what this process's hardware decides is decided here."""
    inputs = from_ranks_env()[1]
    if not inputs:
        raise ConfigError(f"{FROM_PLAN}: no trainer inputs in ${PLAN_ENV} (vf-rl sets it); by hand: vf-train @ CONFIG")
    run = RunFile.from_plan(inputs["config"])
    return train_and_evaluate(inputs["model"], load_env(run), build_rl_config(inputs["args"]), run)


if __name__ == "__main__":
    main()
