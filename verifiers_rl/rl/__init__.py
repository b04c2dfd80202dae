"""verifiers 0.1.14 import paths (`verifiers.rl` imports `verifiers_rl.rl.trainer` and `verifiers_rl.rl.inference`).
Only aliases live here; the code lives in the stage packages (`verifiers_rl.config`, `.trainer`, `.serving`, ...)."""
