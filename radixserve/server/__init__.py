"""The HTTP server: `create_app(front, settings)` in `app`. At this level, the request skeleton
every route shares (exchange, serving, transport, errors, validation, auth, context, prompts,
accounting, settings, and `front`, what the server needs of an engine); below it, one package
per thing served: `openai/`, `anthropic/`, `tool_calls/` and `observability/`."""
