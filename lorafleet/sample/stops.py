"""Deciding, after each sampled token, whether a sequence stops there.

Conventions (vLLM's, which Tinker follows):
- a stop token id (EOS included) is kept as the last token of the sequence;
- a stop string ends the sequence at the token that completes it: that token is kept (a
  token list cannot be cut inside a token, and the training side needs every token the model
  actually emitted), while vLLM's *text* would exclude the string itself. This engine returns
  tokens only, so callers that render text cut the string off themselves.
Stop strings are matched on the decoded text of the generated tokens only (never the prompt),
with special tokens kept in the text so a stop string like "<|im_end|>" works too. Each check
decodes a short tail window, not the whole sequence: a string of L characters is produced by at
most 4L byte-level tokens, so older tokens cannot be part of a new match.
"""

from __future__ import annotations

from typing import Any

from lorafleet.sample.validate import StopSpec

_WINDOW_SLACK = 8


class StopChecker:
    """One per sequence; `update` is called once per appended token."""

    def __init__(self, spec: StopSpec, tokenizer: Any | None):
        if spec.strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.token_ids = spec.token_ids
        self.strings = spec.strings
        self.tokenizer: Any = tokenizer  # not None whenever there are stop strings (checked above)
        self.window = 4 * max((len(s) for s in spec.strings), default=0) + _WINDOW_SLACK

    def update(self, tokens: list[int]) -> bool:
        """True when the last token of `tokens` (the generated ones) ends the sequence."""
        if tokens[-1] in self.token_ids:
            return True
        if not self.strings:
            return False
        tail = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=False)
        return any(s in tail for s in self.strings)
