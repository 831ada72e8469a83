"""The OpenAI API: completions, chat, tokenize and the model list; request schemas, prompts (chat
templates, tokenization), generation (jobs queued, token events awaited), choices and logprobs, SSE,
sampling defaults, the response cache and a request's accounting."""
