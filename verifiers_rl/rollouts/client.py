"""The client every rollout talks through: verifiers' OpenAI chat client, plus a per-rollout sampling seed, the
server's policy version on each response, and a lean HTTP path for the request itself.

Why a lean path: the OpenAI SDK spends its CPU on request transforms, httpx/anyio plumbing and lenient response
construction, and it runs in the trainer's process, on the cores that train. Posting the same JSON with aiohttp
and validating the reply into the SDK's `ChatCompletion` takes several times less client CPU per request
(`benchmarks/bench_client.py`; docs/performance.md).

What stays exactly as verifiers does it: the request fields (verifiers' `max_tokens` -> `max_completion_tokens`,
`extra_body` merged into the body as the SDK does), the response type, and every error. A reply that is not 200,
or a request the lean path does not understand (streaming, per-request timeouts or query strings, content that
is not JSON), goes through the SDK unchanged, so the exception a caller sees is the SDK's own.
"""

from __future__ import annotations

import hashlib
import json

import verifiers as vf
from openai import APIConnectionError, APITimeoutError, AsyncOpenAI
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

from verifiers_rl.rollouts.rollouts import POLICY_VERSIONS_KEY
from verifiers_rl.rollouts.stages import SERVER, Stages

ROLLOUT_KEY = "vf_rl_rollout"  # added to each input row; our client derives the sampling seed from it
# request options that are JSON body fields (or headers) as they are; anything else takes the SDK's path
_SDK_ONLY = frozenset({"stream", "stream_options", "extra_query", "timeout"})


def rollout_seed(base_seed: int, key: str, turn: int) -> int:
    digest = hashlib.blake2b(f"{base_seed}|{key}|{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF


def chat_request_body(model: str, messages, sampling_args: dict, tools=None) -> tuple[dict, dict]:
    """(JSON body, extra headers) of the chat request the SDK would send for verifiers' arguments."""
    args = {k: v for k, v in sampling_args.items() if v is not None}
    if "max_tokens" in args:  # verifiers renames it before calling the SDK
        args["max_completion_tokens"] = args.pop("max_tokens")
    headers = dict(args.pop("extra_headers", None) or {})
    extra = args.pop("extra_body", None) or {}
    body = {"model": model, "messages": messages, **({"tools": tools} if tools else {}), **args}
    body.update(extra)  # the SDK merges extra_body over the named fields
    return body, headers


class RolloutClient(vf.OpenAIChatCompletionsClient):
    """verifiers' chat client plus a per-rollout, per-turn seed and the server's policy version per response."""

    def __init__(self, client: AsyncOpenAI, base_seed: int | None, lean: bool = True, stages: Stages | None = None):
        super().__init__(client)
        self.stages = stages or Stages()  # requests in flight are the generation stage (stages.py)
        self.base_seed = base_seed
        self.lean = lean
        self.sdk_fallbacks = 0  # replies sent or built by the SDK's path (tests check the common case takes none)
        self._session = None

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        state = kwargs.get("state")
        key = _input_value(state, ROLLOUT_KEY) if state is not None else None
        if self.base_seed is not None and key is not None:
            turn = len(state.get("trajectory") or [])
            sampling_args = {**sampling_args, "seed": rollout_seed(self.base_seed, key, turn)}
        response = None
        with self.stages.track("generation", SERVER):
            if self.lean and not (_SDK_ONLY & sampling_args.keys()):
                response = await self._post(prompt, model, sampling_args, tools, kwargs.get("extra_headers"))
            if response is None:
                self.sdk_fallbacks += 1
                response = await super().get_native_response(prompt, model, sampling_args, tools, **kwargs)
        if state is not None:
            version = (getattr(response, "model_extra", None) or {}).get("policy_version")
            state.setdefault(POLICY_VERSIONS_KEY, []).append(version)
        return response

    async def _post(self, prompt, model, sampling_args, tools, extra_headers=None) -> ChatCompletion | None:
        """The reply as the SDK's `ChatCompletion`, or None: let the SDK send it (and raise its own error)."""
        import aiohttp

        body, headers = chat_request_body(model, prompt, sampling_args, tools)
        headers.update(extra_headers or {})  # verifiers' headers from state (e.g. session routing)
        try:
            payload = json.dumps(body).encode()
        except (TypeError, ValueError):
            return None
        url = str(self.client.base_url).rstrip("/") + "/chat/completions"
        session = self._get_session()
        try:
            async with session.post(url, data=payload, headers=headers or None) as reply:
                raw = await reply.read()
                status = reply.status
        except TimeoutError as e:
            raise APITimeoutError(request=self._request(url)) from e
        except aiohttp.ClientConnectionError as e:
            raise APIConnectionError(message=f"{type(e).__name__}: {e}", request=self._request(url)) from e
        if status != 200:
            return None
        data = json.loads(raw)
        try:
            return ChatCompletion.model_validate(data)
        except ValidationError:
            # a server's reply the strict schema rejects (a field vLLM fills differently): the SDK's lenient build
            self.sdk_fallbacks += 1
            return ChatCompletion.construct(**data)

    def _get_session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            timeout = self.client.timeout
            total = timeout if isinstance(timeout, (int, float)) else getattr(timeout, "read", None)
            # the SDK adds its auth headers per request, outside default_headers (a vLLM run with --api-key needs them)
            sdk_headers = {**self.client.default_headers, **self.client.auth_headers}
            headers = {k: v for k, v in sdk_headers.items() if isinstance(v, str)}
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=total),
                connector=aiohttp.TCPConnector(limit=1000),  # the SDK's default connection limit
            )
        return self._session

    def _request(self, url: str):
        return self.client._client.build_request("POST", url)  # the SDK's error types carry its HTTP request

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await super().close()


def _input_value(state, key):
    inp = state.get("input") if hasattr(state, "get") else None
    if isinstance(inp, dict) and key in inp:
        return inp[key]
    return None
