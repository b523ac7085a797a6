"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions and /v1/models (`routes`),
their request and response shapes (`protocol`), and each route's exchange (`chat`,
`completions`, over `exchange`'s shared parts)."""
