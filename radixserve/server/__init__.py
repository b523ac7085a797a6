"""The HTTP server: `create_app(aengine, settings)` in `app`, the OpenAI routes in
`openai_routes`, and `radixserve serve` in `cli` (kept import-light for `--help`)."""
