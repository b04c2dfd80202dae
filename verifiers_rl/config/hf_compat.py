"""`TrainingArguments` with the activation-checkpointing names of transformers >= 5.20 on every supported version.

transformers 5.20 renamed `gradient_checkpointing(_kwargs)` to `activation_checkpointing(_kwargs)` (the old names
stay as deprecated aliases); vLLM 0.32, our `vllm` extra, pins transformers < 5.20, where only the old names
exist. The code, configs and docs use the new names: on an older transformers the two fields are added here and
passed on to the old ones, which Trainer reads there. On 5.20+ this is transformers' own class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments as _HFTrainingArguments

if "activation_checkpointing" in _HFTrainingArguments.__dataclass_fields__:
    TrainingArguments = _HFTrainingArguments
else:

    @dataclass
    class TrainingArguments(_HFTrainingArguments):
        activation_checkpointing: bool = field(
            default=False, metadata={"help": "Recompute activations in the backward pass to save memory."}
        )
        activation_checkpointing_kwargs: dict | None = field(
            default=None, metadata={"help": "Keyword arguments for the model's gradient_checkpointing_enable()."}
        )

        def __post_init__(self):
            if self.activation_checkpointing:
                self.gradient_checkpointing = True
            if self.activation_checkpointing_kwargs is not None:
                self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
            super().__post_init__()
