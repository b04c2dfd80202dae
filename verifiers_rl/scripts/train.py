"""`vf-train @ cfg.toml [--section.key value ...]`: the trainer only, against a server that already runs
(`vf-vllm`, or the one `vf-rl` started). Server address from [inference] host/port; control token from
$VF_CONTROL_TOKEN. Also the per-process entry point when `vf-rl` runs the trainer under `accelerate launch`.
"""

from __future__ import annotations

import sys

from verifiers_rl.scripts.common import load_env, resolve_model, run_cli, split_argv
from verifiers_rl.scripts.toml_config import apply_overrides, load, rl_config, validate


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        from verifiers_rl.rl.trainer import RLTrainer
        from verifiers_rl.scripts.report import write_report

        path, overrides, flags = split_argv(argv, "vf-train")
        cfg = validate(apply_overrides(load(path), overrides), "vf-train")
        model = None
        if "sft" in cfg:
            from verifiers_rl.scripts.sft import sft_plan

            model = sft_plan(cfg["sft"]["config"], dry_run=True)["final_dir"]
        model = model or resolve_model(cfg)
        inf = cfg.get("inference", {})
        args = rl_config(
            cfg,
            server_mode="connect",
            vllm_server_host=inf.get("host", "127.0.0.1"),
            vllm_server_port=inf.get("port", 8000),
            server_engine=inf.get("engine", "auto"),
        )
        if "--dry-run" in flags:
            print(
                f"vf-train: would train {model} on {cfg['env']['id']} against "
                f"http://{args.vllm_server_host}:{args.vllm_server_port} -> {args.output_dir}"
            )
            return 0
        trainer = RLTrainer(model=model, env=load_env(cfg), args=args)
        try:
            trainer.train()
        finally:
            trainer.close()
        if trainer.is_world_process_zero():
            write_report(args.output_dir, None, None)
        return 0

    return run_cli("vf-train", body)


if __name__ == "__main__":
    sys.exit(main())
