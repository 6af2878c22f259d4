"""OpenAI-compatible routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) over the
same intake, scheduler and sampler as the Tinker `sample` route, so fair share, quotas,
metering and the configured rollout engine apply alike. docs/openai_api.md is the user's guide.

Modules: `errors` (OpenAI's error shape), `requests` (bodies into a typed `Ask`), `text`
(the base tokenizer: prompts, chat template, decoding, stop strings), `models` (what a `model`
names, and the listing), `render` (responses and stream chunks), `service` (submit, wait,
stream)."""
