"""The OpenAI-compatible HTTP service: app, routes, schemas, middleware, streaming, caches and
limits."""
