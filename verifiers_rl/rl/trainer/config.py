"""verifiers 0.1.14 import path: `verifiers_rl.config.rl_config` under its old name (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("verifiers_rl.config.rl_config")
