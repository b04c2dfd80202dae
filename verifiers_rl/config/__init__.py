"""Stage 1, configuration: what the user asks for. `RLConfig` (a `TrainingArguments` dataclass whose field metadata is
the one home of every setting, its help and its TOML spelling), the checks that name a bad key, the TOML reader
(`[model]`, `[env]`/`[[env]]`, `[inference]`, `[trainer.args]`) and verifiers' hosted-config translation, the LoRA
defaults, and the names older verifiers code still passes."""
