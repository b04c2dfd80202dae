"""A checkpoint's generation_config.json sampling defaults (Qwen3 ships top_k 20, top_p 0.95, temperature 0.6) never
reach the distribution a rollout is sampled from: the trainer scores the full distribution at the config's
temperature, so the server must sample exactly that. Both engines over real HTTP; real vLLM (CPU build) when
VF_VLLM_PYTHON is set, spawned by us and as a user's own server started without `--generation-config vllm`.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from servers import ENGINES, VLLM_PYTHON, start_server
from transformers import AutoModelForCausalLM, GenerationConfig

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.loss.logprobs import chunked_logprobs
from verifiers_rl.rollouts.client import chat_request_body

MSG = [{"role": "user", "content": "Reverse: hello"}]
# Qwen3's shipped sampling defaults
QWEN3_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


@pytest.fixture(scope="module")
def defaults_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with Qwen3's sampling defaults in its generation_config.json."""
    path = tmp_path_factory.mktemp("gen-defaults") / "model"
    shutil.copytree(tiny_model_dir, path)
    GenerationConfig(
        **QWEN3_DEFAULTS, eos_token_id=GenerationConfig.from_pretrained(path).eos_token_id
    ).save_pretrained(path)
    assert GenerationConfig.from_pretrained(path).top_k == 20
    return str(path)


@pytest.fixture(scope="module")
def trainer_model(defaults_model_dir):
    return AutoModelForCausalLM.from_pretrained(defaults_model_dir, dtype=torch.float32).eval()


def _trainer_logprobs(model, prompt_ids: list[int], ids: list[int]) -> torch.Tensor:
    """What the trainer scores: the full distribution at temperature 1 (its own chunked logprob kernel)."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt_ids + ids])).last_hidden_state[0, len(prompt_ids) - 1 : -1]
        logp, _ = chunked_logprobs(hidden, model.lm_head.weight, torch.tensor(ids), with_entropy=False)
    return logp


def _sample(base_url: str, body: dict) -> tuple[list[int], list[int], torch.Tensor]:
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    got = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    return out["prompt_token_ids"], choice["token_ids"], got


def _trainer_request(model_dir: str, tmp_path) -> dict:
    """The body the trainer's rollout client posts for a default config (temperature 1, nothing else set)."""
    cfg = RLConfig(output_dir=str(tmp_path), use_cpu=True, max_tokens=24)
    body, _ = chat_request_body(model_dir, MSG, {**cfg.sampling_args, "seed": 7})
    return body


def _bare_request(model_dir: str) -> dict:
    """A request that states no sampling field: the server's defaults decide."""
    return {"model": model_dir, "messages": MSG, "max_tokens": 24, "logprobs": True, "return_token_ids": True,
            "seed": 7}  # fmt: skip


def _gap(model, base_url: str, body: dict) -> float:
    prompt_ids, ids, got = _sample(base_url, body)
    assert len(ids) >= 8  # enough sampled tokens to see a top_k 20 / temperature 0.6 distribution
    return float((got - _trainer_logprobs(model, prompt_ids, ids)).abs().max())


@pytest.fixture(scope="module", params=ENGINES)
def server(request, defaults_model_dir, tmp_path_factory):
    srv = start_server(request.param, defaults_model_dir, tmp_path_factory.mktemp(f"srv-{request.param}"))
    yield srv
    srv.stop()


def test_the_sampled_distribution_is_the_one_the_trainer_scores(server, trainer_model, defaults_model_dir, tmp_path):
    """Our server (CPU engine, or vLLM started by vf-vllm with `--generation-config vllm`) ignores the checkpoint's
    defaults both for the trainer's request and for a request that states nothing."""
    for body in (_trainer_request(defaults_model_dir, tmp_path), _bare_request(defaults_model_dir)):
        assert _gap(trainer_model, server.base_url, body) < 1e-4, body


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="set VF_VLLM_PYTHON to the vLLM CPU venv's python")
def test_a_users_vllm_applies_the_checkpoint_defaults_unless_the_request_states_them(
    trainer_model, defaults_model_dir, tmp_path
):
    """A server the trainer only connects to may be started without `--generation-config vllm` (here
    `--generation-config auto`, vLLM's own default): it samples a bare request with top_k 20 / temperature 0.6, and
    only the fields the trainer's request states explicitly keep the sampled distribution the scored one."""
    from verifiers_rl.serving.launcher import InferenceServer

    srv = InferenceServer(
        defaults_model_dir, engine="vllm", output_dir=tmp_path / "srv", python=VLLM_PYTHON, startup_timeout=240,
        extra_args=["--generation-config", "auto", "--weight-transfer-backend", "gloo", "--max-model-len", "1024",
                    "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    srv.start()
    try:
        assert _gap(trainer_model, srv.base_url, _bare_request(defaults_model_dir)) > 0.5  # the defaults are live
        assert _gap(trainer_model, srv.base_url, _trainer_request(defaults_model_dir, tmp_path)) < 1e-4
    finally:
        srv.stop()
