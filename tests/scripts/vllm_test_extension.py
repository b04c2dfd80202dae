"""A worker extension for tests/e2e/test_vllm_gloo.py: ours (`WorkerExtension`), plus a refusal one chosen
data-parallel engine gives when the update's config asks for it (`REFUSE_KEY`), as an engine whose state differs
from the others would. vLLM's /collective_rpc answers with the first engine's results only; the test shows the
trainer still hears engine 1's refusal. Imported by vLLM's worker processes (tests/scripts on PYTHONPATH)."""

from verifiers_rl.inference.vllm.extension import WorkerExtension

REFUSE_KEY = "vf_test_refuse_on_engine"


class RefusingExtension(WorkerExtension):
    def _vf_install(self, lora_id: int, tensors: dict, peft_config: dict) -> None:
        config = {k: v for k, v in peft_config.items() if k != REFUSE_KEY}
        engine = self.vllm_config.parallel_config.data_parallel_index
        if peft_config.get(REFUSE_KEY) == engine:
            raise ValueError(f"this update is refused on data-parallel engine {engine} (asked by the test)")
        super()._vf_install(lora_id, tensors, config)
