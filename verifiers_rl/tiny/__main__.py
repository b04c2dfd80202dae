"""python -m verifiers_rl.tiny DIR [--hidden H --layers L --seed S]"""

import argparse
import sys

from verifiers_rl.tiny import TinySpec, save_tiny_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m verifiers_rl.tiny",
        description="Write a deterministic tiny Qwen3 model + byte-level tokenizer to DIR (offline).",
    )
    p.add_argument("dir", help="output directory (created if missing)")
    p.add_argument("--hidden", type=int, default=TinySpec.hidden, help="hidden size, a multiple of --head-dim")
    p.add_argument("--layers", type=int, default=TinySpec.layers, help="number of decoder layers")
    p.add_argument("--head-dim", type=int, default=TinySpec.head_dim, help="attention head size (>= 32 for vLLM CPU)")
    p.add_argument("--seed", type=int, default=TinySpec.seed, help="weight-init seed; same seed, same bytes")
    args = p.parse_args(argv)
    try:
        out = save_tiny_model(args.dir, hidden=args.hidden, layers=args.layers, seed=args.seed, head_dim=args.head_dim)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote tiny model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
