import pytest
import torch

from verifiers_rl.models import ensure_pad_token, get_tokenizer, resolve_model_path, weight_bytes
from verifiers_rl.tiny import build_tiny_model
from verifiers_rl.trainer import get_model, get_model_and_tokenizer


def test_local_path_cpu_defaults(tiny_model_dir):
    model, tok = get_model_and_tokenizer(tiny_model_dir, device="cpu")
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert tok.pad_token_id != tok.eos_token_id


def test_model_kwargs_override_dtype(tiny_model_dir):
    model = get_model(tiny_model_dir, model_kwargs={"torch_dtype": torch.bfloat16}, device="cpu")
    assert model.dtype == torch.bfloat16


def test_missing_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_model("./relative/missing-model")


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        get_model(str(tmp_path))


def test_file_instead_of_dir(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="pass the directory"):
        resolve_model_path(str(f))


def test_hub_id_offline_gives_actionable_error():
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set"):
        get_model("some-org/definitely-not-cached-model")


def test_empty_name():
    with pytest.raises(ValueError, match="hub id or a local directory"):
        resolve_model_path("  ")


def test_liger_requested_but_missing_warns(tiny_model_dir):
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel installed")
    with pytest.warns(UserWarning, match="liger-kernel is not installed"):
        get_model(tiny_model_dir, use_liger=True, device="cpu")


def test_pad_token_prefers_existing_non_eos_token():
    model, tok = build_tiny_model()
    tok.pad_token = tok.eos_token  # the aliasing we must undo
    n = len(tok)
    assert ensure_pad_token(tok, model) is False
    assert tok.pad_token == "<|endoftext|>" and len(tok) == n
    assert model.config.pad_token_id == tok.pad_token_id


def test_pad_token_added_and_model_resized_when_no_candidate():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")
    model, _ = build_tiny_model()
    before = model.get_input_embeddings().num_embeddings
    tok.add_tokens([f"t{i}" for i in range(before)])  # make the vocab outgrow the model
    assert ensure_pad_token(tok, model) is True
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    assert model.get_input_embeddings().num_embeddings >= len(tok)


def test_tokenizer_without_chat_template_rejected(tmp_path, tiny_model_dir):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        get_tokenizer(str(d))


def test_weight_bytes_counts_each_parameter_at_its_stored_width():
    model, _ = build_tiny_model()
    n = sum(p.numel() for p in model.parameters())
    assert weight_bytes(model) == 4 * n  # fp32
    model.to(torch.bfloat16)
    assert weight_bytes(model) == 2 * n
