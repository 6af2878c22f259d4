"""OpenAI request bodies into one typed `Ask`, each field checked by name before any work.

Fields that only describe the caller (`user`, `metadata`, `store`, `service_tier`, ...) are
ignored, as OpenAI-compatible servers do; fields that would change what is
generated and that this server cannot honour (tools, response formats, penalties, logit bias,
echo, ...) are refused with a 400 naming them, never silently dropped: a caller relying on them
would get an answer that looks right and is not."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lorafleet.sample.validate import MAX_SEED
from lorafleet.server.http.parse import MAX_STOP_CHARS
from lorafleet.server.http.served import RequestLimits
from lorafleet.server.openai.errors import OpenAIError, unsupported
from lorafleet.server.openai.text import Text

MAX_STOPS = 16
MAX_MESSAGES = 1024

# field -> the value(s) under which it changes nothing (anything else is refused)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}
_WHY = {
    "tools": "there is no tool calling",
    "functions": "there is no function calling",
    "tool_choice": "there is no tool calling",
    "function_call": "there is no function calling",
    "response_format": "output is not constrained to a format",
    "logit_bias": "logits cannot be biased",
    "echo": "the prompt is not echoed back",
    "suffix": "there is no insertion mode",
}


@dataclass(frozen=True)
class Ask:
    chat: bool
    model: str
    prompt: list[int]
    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None  # None: none; k: the sampled token's and the top k
    stream: bool
    include_usage: bool


def _int(body: dict[str, Any], field: str, lo: int, hi: int | None) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < lo
        or (hi is not None and value > hi)
    ):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise OpenAIError(f"{field} must be an integer {bound}, got {value!r}", field)
    return value


def _float(body: dict[str, Any], field: str, lo: float, hi: float, default: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise OpenAIError(f"{field} must be a number between {lo} and {hi}, got {value!r}", field)
    return float(value)


def _top_p(body: dict[str, Any]) -> float:
    top_p = _float(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise OpenAIError("top_p must be in (0, 1], got 0", "top_p")
    return top_p


def _bool(body: dict[str, Any], field: str) -> bool:
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"{field} must be true or false, got {value!r}", field)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or not 1 <= len(stops) <= MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise OpenAIError(
            f"stop must be a non-empty string or a list of 1 to {MAX_STOPS} of them, got {value!r}",
            "stop",
        )
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            where = "stop" if isinstance(value, str) else f"stop[{i}]"
            raise OpenAIError(
                f"{where} is {len(s)} characters long; this server takes stop strings of at most "
                f"{MAX_STOP_CHARS} characters (each is checked at every sampled token)",
                "stop",
            )
    return tuple(dict.fromkeys(stops))


def _refuse_unhonoured(body: dict[str, Any]) -> None:
    for field, neutral in _NEUTRAL.items():
        value = body.get(field)
        if field in body and not any(type(value) is type(v) and value == v for v in neutral):
            raise unsupported(field, _WHY.get(field, f"only {neutral[-1]!r} is accepted"))


def _common(body: Any, limits: RequestLimits) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object", None)
    _refuse_unhonoured(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(f"model must be a non-empty string, got {model!r}", "model")
    n = _int(body, "n", 1, limits.max_num_samples) or 1
    best_of = _int(body, "best_of", 1, None)
    if best_of is not None and best_of != n:
        raise unsupported("best_of", "every sample drawn is returned; use n")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise OpenAIError(
            f'stream_options must be {{"include_usage": bool}}, got {options!r}', "stream_options"
        )
    include_usage = stream and _bool(options or {}, "include_usage")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIError(f"seed must be an integer, got {seed!r}", "seed")
    if seed is not None and not -MAX_SEED < seed < MAX_SEED:
        raise OpenAIError(
            f"seed must be a 64-bit integer, got one of {seed.bit_length()} bits", "seed"
        )
    return {
        "model": model,
        "n": n,
        "temperature": _float(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _top_p(body),
        "top_k": _int(body, "top_k", -1, None) or -1,
        "stop": _stop(body.get("stop")),
        "seed": seed,
        "stream": stream,
        "include_usage": include_usage,
    }


def completion(body: Any, text: Text, limits: RequestLimits) -> Ask:
    common = _common(body, limits)
    logprobs = _int(body, "logprobs", 0, limits.max_topk_logprobs)
    return Ask(
        chat=False,
        prompt=_prompt(body.get("prompt"), text, limits.max_prompt_bytes),
        max_tokens=_int(body, "max_tokens", 1, None),
        logprobs=logprobs,
        **common,
    )


def chat(body: Any, text: Text, limits: RequestLimits) -> Ask:
    common = _common(body, limits)
    max_tokens = _int(body, "max_completion_tokens", 1, None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, None)
    top = _int(body, "top_logprobs", 0, limits.max_topk_logprobs)
    wants = _bool(body, "logprobs")
    if top is not None and not wants:
        raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
    return Ask(
        chat=True,
        prompt=text.chat(
            _messages(body.get("messages"), limits.max_prompt_bytes), limits.max_prompt_bytes
        ),
        max_tokens=max_tokens,
        logprobs=(top or 0) if wants else None,
        **common,
    )


def text_bytes(value: str) -> int:
    """UTF-8 length; a string longer in characters than `cap` is over it without encoding."""
    return len(value.encode("utf-8"))


def _check_bytes(size: int, cap: int, field: str, what: str) -> None:
    if size > cap:
        raise OpenAIError(
            f"{what} is {size} bytes, more than this server's limit of {cap} bytes of text per "
            "request (max_prompt_bytes in get_server_capabilities' lorafleet_limits): it could "
            "not fit the model's context; shorten it",
            field,
            code="context_length_exceeded",
        )


def _prompt(value: Any, text: Text, cap: int) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str) and value:
        # before the tokenizer, whose time and memory grow with the text
        _check_bytes(len(value) if len(value) > cap else text_bytes(value), cap, "prompt", "prompt")
        return text.encode(value)
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list) for v in value):
        raise OpenAIError(
            f"prompt holds {len(value)} prompts; this server takes one prompt per request "
            "(send one request per prompt, or use n for several samples of one)",
            "prompt",
        )
    raise OpenAIError(
        "prompt must be a non-empty string or a non-empty list of token ids", "prompt"
    )


def _messages(value: Any, cap: int) -> list[dict[str, str]]:
    """The messages as the chat template takes them; their content together at most `cap`
    bytes (checked as each is read, before the template or the tokenizer runs)."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise OpenAIError(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    out: list[dict[str, str]] = []
    total = 0
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise OpenAIError(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise OpenAIError(
                f"{where}.role {role!r} is not supported (system, developer, user, assistant; "
                "there is no tool calling)",
                f"{where}.role",
            )
        for field in ("tool_calls", "function_call", "audio"):
            if message.get(field) not in (None, []):
                raise unsupported(f"{where}.{field}", "there is no tool calling or audio")
        # "developer" is OpenAI's newer name for "system", which chat templates know
        role = "system" if role == "developer" else str(role)
        content = _content(message.get("content"), where)
        total += len(content) if len(content) > cap else text_bytes(content)
        _check_bytes(total, cap, "messages", f"the content of messages[0..{i}]")
        out.append({"role": role, "content": content})
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str] = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(
                    f"{where}.content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                    f"got type {kind!r} (this server takes text only)",
                    f"{where}.content[{j}].type",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIError(
        f"{where}.content must be a string or a list of text parts", f"{where}.content"
    )
