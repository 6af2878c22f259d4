"""What an OpenAI response carries, estimated from the request before it runs.

The Tinker route's estimate (`parse.response_bytes`) counts protobuf bytes: 8 per token and per
top-k entry. The OpenAI routes answer JSON, where every log-prob entry is an object with the
token's text, its log-prob as a 17-digit float, and (chat) the token's UTF-8 bytes as a list of
integers, and where each of the `n` choices repeats all of it: `n=36`, 1,000 tokens and
`top_logprobs=20` is 756,000 such objects, about 23 MB, which the protobuf estimate put at
6 MiB. The server holds the response as Python objects until it is encoded (several times the
wire size), so this estimate, checked against `max_response_bytes`, is what bounds a request's
memory. Constants are averages over BPE vocabularies (a token's text is 4-7 bytes; the
streaming route escapes non-ASCII), rounded up; tests/server/test_openai_caps.py checks the
estimate against real responses."""

from __future__ import annotations

from lorafleet.server.openai.asks import Ask

TOKEN_TEXT_BYTES = 10  # one token's text as JSON carries it (escapes included), on average
# chat: {"token":"..","logprob":-0.12345678901234567,"bytes":[..]} and each byte as "123,"
CHAT_ENTRY_BYTES = 48 + TOKEN_TEXT_BYTES + 4 * 7
CHAT_TOP_LIST_BYTES = 18  # ,"top_logprobs":[] of each sampled token's entry
# completions: "..", in tokens, -0.123..., in token_logprobs, an offset, and a {..} of top-k
# entries "..":-0.123...,
COMPLETION_TOKEN_BYTES = (TOKEN_TEXT_BYTES + 3) + 22 + 8 + 2
COMPLETION_TOP_ENTRY_BYTES = TOKEN_TEXT_BYTES + 4 + 22
CHOICE_BYTES = 256  # index, message/role or text, finish_reason, logprobs' framing
HEAD_BYTES = 512  # id, object, created, model, usage
# a stream sends each new piece of a choice's text as its own event, head repeated:
# data: {"id":..,"object":"chat.completion.chunk","created":..,"model":..,"choices":[{..}]}
STREAM_EVENT_BYTES = 240


def openai_response_bytes(ask: Ask, max_new_tokens: int) -> int:
    """The most an OpenAI response to `ask` carries as JSON, every choice running to
    `max_new_tokens` (a stop may end it sooner, never later)."""
    per_token = TOKEN_TEXT_BYTES  # the text itself
    if ask.logprobs is not None:
        k = ask.logprobs
        if ask.chat:
            per_token += CHAT_ENTRY_BYTES + CHAT_TOP_LIST_BYTES + k * CHAT_ENTRY_BYTES
        else:
            per_token += COMPLETION_TOKEN_BYTES + k * COMPLETION_TOP_ENTRY_BYTES
    if ask.stream:  # at most one event per token, each repeating the head and the model name
        per_token += STREAM_EVENT_BYTES + len(ask.model.encode("utf-8", "replace"))
    return HEAD_BYTES + ask.n * (CHOICE_BYTES + max_new_tokens * per_token)
