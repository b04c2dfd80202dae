"""`vf-train @ cfg.toml [--section.key value ...]`: the trainer only, against a server that already runs
(`vf-vllm`, or the one `vf-rl` started). Server address from [inference] host/port (or [trainer.args]
vllm_server_host/port; 8000 when unset); control token from $VF_CONTROL_TOKEN. Also the per-process entry point
when `vf-rl` runs the trainer under `accelerate launch`.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from verifiers_rl.config.net import DEFAULT_PORT
from verifiers_rl.config.toml import apply_overrides, load, resolve_path, rl_config, validate
from verifiers_rl.plan.run import from_ranks_env
from verifiers_rl.scripts.common import load_env, resolve_model, run_cli, split_argv, train_and_evaluate
from verifiers_rl.scripts.rl_plan import check_model


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point. It raises SystemExit(code) itself: verifiers' own `vf-*` scripts call `main()`
    and drop its return value, and whichever package was installed last owns the script name."""
    raise SystemExit(run_command(argv))


def run_command(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        path, overrides, flags = split_argv(argv, "vf-train")
        cfg = validate(apply_overrides(load(path), overrides), "vf-train")
        model = None
        if "sft" in cfg:
            from verifiers_rl.scripts.sft import sft_plan

            model = sft_plan(resolve_path(cfg["sft"]["config"], path), dry_run=True)["final_dir"]
        if model is None:
            model = resolve_model(cfg, path)
            check_model(model, dry_run="--dry-run" in flags)
        # a trainer process vf-rl started follows vf-rl's plan, including the settings its memory fit chose
        args = rl_config(cfg, server_mode="connect", config_path=path, **from_ranks_env()[1])
        if "--dry-run" in flags:
            print(
                f"vf-train: would train {model} on {cfg['env']['id']} against "
                f"http://{args.vllm_server_host}:{args.vllm_server_port or DEFAULT_PORT} -> {args.output_dir}"
            )
            return 0
        return train_and_evaluate(model, load_env(cfg), args, cfg)

    return run_cli("vf-train", body)


if __name__ == "__main__":
    main()
