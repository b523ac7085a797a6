"""What the server tells about itself: Prometheus /metrics (`metrics`, with vLLM-named twins in
`metrics_compat`), the cache statistics behind GET /v1/cache/stats (`cache_stats`,
`stats_routes`) and the dashboard page that draws them (`dashboard`, `static/`)."""
