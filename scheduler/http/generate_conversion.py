"""SGLang's native ``/generate`` body as scheduler requests: its ``sampling_params`` (SGLang's spellings: ``n``,
``sampling_seed``, ``top_k`` -1, a single ``stop`` string, ``custom_params``) and logprob fields."""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any

import msgspec

from scheduler.http.openai_fields import refuse_unimplemented
from scheduler.http.protocol import MAX_N, SEED_MODULUS, GenerateRequest, ProtocolError
from scheduler.http.reasoning_fields import thinking_budget
from scheduler.http.request_conversion import (
    BOOLEAN_SCHEMAS,
    RequestLimits,
    SchedulerCall,
    check_num_requests,
    checked_params,
    for_choice,
    prompt_call,
    prompt_list,
)
from scheduler.io_struct import SamplingParams

GENERATE_BOOKKEEPING_FIELDS: dict[str, str] = {
    "model": "the served model's name or null (any other name is a 404, as on the OpenAI endpoints)",
    "log_metrics": "the server's Prometheus counters count every request alike; none are kept per request",
    "no_logs": "no request's text is logged here (a request's log line holds its rid, token counts and timings)",
}
"""Top-level ``/generate`` fields of SGLang's that cannot change the answer, with the reason (SGLang's router sends
them on every request)."""

GENERATE_REFUSED_FIELDS: dict[str, str] = {
    "return_hidden_states": "the model's hidden states are not returned by this server",
    "background": "requests run in the background (answered later by id) are not implemented",
    "return_bytes": "the output tokens' bytes are not returned by this server",
    "return_entropy": "the output tokens' entropy is not computed by this server",
}
"""Top-level ``/generate`` fields refused (400, ``unsupported_parameter``) when true: SGLang's router sends them false
on every request, and ignoring a true one would withhold what was asked for."""


def generate_calls(request: GenerateRequest, limits: RequestLimits) -> list[SchedulerCall]:
    """``n`` scheduler requests per prompt of a native ``/generate`` body (a batch when ``text`` is a list), in
    prompt-major order; choice ``i`` of a seeded request is seeded ``seed + i``."""
    refuse_unimplemented(request, GENERATE_REFUSED_FIELDS)
    sources = [name for name in ("text", "input_ids") if getattr(request, name) is not None]
    if len(sources) != 1:
        raise ProtocolError(f"give exactly one of text or input_ids (got {', '.join(sources) or 'neither'})")
    prompts = prompt_list(request.text if request.text is not None else request.input_ids)
    if not prompts:
        raise ProtocolError("the batch of prompts is empty", param=sources[0])
    if request.return_logprob and request.logprob_start_len != -1:
        raise ProtocolError(
            "logprob_start_len must be -1: prompt (input) logprobs are not computed by this server, only output ones",
            param="logprob_start_len",
        )
    raw, n = _native_sampling_fields(request.sampling_params)
    check_num_requests(len(prompts), n)
    rids = [request.rid] if isinstance(request.rid, str) else request.rid
    if rids is not None and len(rids) != len(prompts):
        raise ProtocolError(f"rid has {len(rids)} entries for {len(prompts)} prompts", param="rid")
    try:
        params = msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"sampling_params: {e}", param="sampling_params") from e
    params = _check_native_params(params, limits)
    top_logprobs_num = request.top_logprobs_num if request.return_logprob else None
    calls = []
    for p, prompt in enumerate(prompts):
        rid = rids[p] if rids is not None else uuid.uuid4().hex
        for i in range(n):
            choice_rid = rid if n == 1 else f"{rid}-{i}"
            call = prompt_call(choice_rid, for_choice(params, i), prompt, top_logprobs_num, request.prediction)
            calls.append(dataclasses.replace(call, separate_reasoning=request.separate_reasoning))
    return calls


def _native_sampling_fields(sampling_params: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """SGLang's ``sampling_params`` as ``SamplingParams`` fields, and ``n``: null means the default, ``stop`` may be
    one string, ``top_k`` -1 means no limit, ``sampling_seed`` is ``seed``; of ``custom_params`` (for a custom
    logit processor, which this server does not run) only ``thinking_budget`` is taken. ``require_reasoning`` is
    true unless set: on a server with ``--reasoning-parser`` the model may think first."""
    raw = {name: value for name, value in sampling_params.items() if value is not None}
    if isinstance(raw.get("json_schema"), bool):
        raise ProtocolError(BOOLEAN_SCHEMAS[str(raw["json_schema"]).lower()], param="json_schema")
    n = raw.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ProtocolError(f"sampling_params.n must be an integer in [1, {MAX_N}], got {n!r}", param="n")
    budget = thinking_budget(None, raw.pop("custom_params", None))
    if budget is not None and raw.setdefault("thinking_budget", budget) != budget:
        raise ProtocolError(
            "sampling_params.thinking_budget and custom_params.thinking_budget differ: give one",
            param="thinking_budget",
        )
    raw.setdefault("require_reasoning", True)
    if "sampling_seed" in raw:
        seed = raw.pop("sampling_seed")
        if raw.setdefault("seed", seed) != seed:
            raise ProtocolError("sampling_params.seed and sampling_seed differ: give one", param="sampling_seed")
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if raw.get("top_k") == -1:
        del raw["top_k"]
    return raw, n


def _check_native_params(params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(params, name)):
            raise ProtocolError(f"sampling_params.{name} must be a finite number", param=name)
    if params.seed is not None and not -(2**63) <= params.seed < SEED_MODULUS:
        raise ProtocolError(f"sampling_params.seed must be in [-2**63, 2**64), got {params.seed}", param="seed")
    return checked_params(params, limits)
