"""The RL stack: `trainer` (config, rollouts, math, training step) and `inference` (engines, client, sync)."""
