"""The Anthropic-compatible API: /v1/messages and /v1/messages/count_tokens (`routes`), their
shapes (`protocol`), a Messages request rendered to a prompt (`prompt`) and the exchange,
streamed as content blocks or whole (`messages`)."""
