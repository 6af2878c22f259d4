"""The base model's tokenizer as the OpenAI routes use it: prompts in, text out.

Loaded once, on the first OpenAI request, from the served base's directory (the same files the
sampler's stop strings use). Text is decoded without special tokens, as vLLM's OpenAI server
does; a stop string ends the text before it (the tokens still hold the one that completed it,
see sample/stops.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorafleet.server.openai.errors import OpenAIError

REPLACEMENT = "\ufffd"  # what a token cut inside a multi-byte character decodes to, for now


class Text:
    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._eos: tuple[str, ...] = ()

    def tokenizer(self) -> Any:  # a transformers tokenizer
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer, GenerationConfig

                tok = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
                ids = {tok.eos_token_id}
                try:
                    gen = GenerationConfig.from_pretrained(
                        str(self.model_dir), local_files_only=True
                    ).eos_token_id
                except OSError:  # no generation_config.json: the tokenizer's EOS alone
                    gen = None
                ids.update(gen if isinstance(gen, list) else [gen])
                self._eos = tuple(
                    sorted({str(tok.convert_ids_to_tokens(i)) for i in ids if isinstance(i, int)})
                )
                self._tokenizer = tok
            return self._tokenizer

    def eos_strings(self) -> tuple[str, ...]:
        """The end-of-sequence tokens as the sampler's stop-string check sees them: a request
        with stop strings must still end at EOS (OpenAI's meaning), while the sampler, as
        Tinker, stops at exactly the strings it is given."""
        self.tokenizer()
        return self._eos

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer()(prompt)["input_ids"])

    def chat(self, messages: list[dict[str, str]], max_bytes: int) -> list[int]:
        """The template's prompt, tokenized; the template's own output (which adds roles and
        markers to the messages, and may repeat them) is held to `max_bytes` before the
        tokenizer runs, as the messages were."""
        tok = self.tokenizer()
        if not getattr(tok, "chat_template", None):
            raise OpenAIError(
                "this server's base model has no chat template, so chat messages cannot be "
                "turned into a prompt; use /v1/completions with a prompt",
                "messages",
            )
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not isinstance(rendered, str):
            raise TypeError(f"the chat template rendered {type(rendered).__name__}, not text")
        size = len(rendered.encode("utf-8"))
        if size > max_bytes:
            raise OpenAIError(
                f"the chat template's output for these messages is {size} bytes, more than this "
                f"server's limit of {max_bytes} bytes of text per request (max_prompt_bytes); "
                "send fewer or shorter messages",
                "messages",
                code="context_length_exceeded",
            )
        # what apply_chat_template(tokenize=True) does: the template holds the special tokens
        return list(tok(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer().decode(list(tokens), skip_special_tokens=True))

    def token(self, token: int) -> str:
        """One token's own text, special tokens included (what logprobs name)."""
        return str(self.tokenizer().decode([token], skip_special_tokens=False))


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(ends)], True) if ends else (text, False)


def safe_prefix(text: str, stops: Sequence[str]) -> str:
    """What may be shown of a sequence still running: not a trailing partial character, and not
    the last characters that could be the start of a stop string."""
    text = text.rstrip(REPLACEMENT)
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: len(text) - hold] if hold else text


class Incremental:
    """A running sequence's text, decoded as its tokens arrive in time proportional to the new
    tokens rather than to the whole sequence (vLLM's incremental detokenizing): the new text is
    what the new tokens add to the decoding of the previous increment's tokens, so a decoder
    that treats the first token specially (SentencePiece drops its leading space) treats both
    sides alike. Text that ends inside a character waits for the token that completes it."""

    def __init__(self, text: Text):
        self._decode = text.decode
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the tokens decoded as context
        self._read = 0  # tokens whose text is in `self.text`

    def add(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if after.endswith(REPLACEMENT) or not after.startswith(before):
            return
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.tokens)
