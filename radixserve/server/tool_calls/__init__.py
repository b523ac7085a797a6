"""Tool calls on both APIs: the declared tools and forced-call grammars (`tools`), model text
read back as calls (`parsers`, `partial` for calls still being generated, `json_spans` for
where their JSON lies) and structured-output requests (`constraints`)."""
