"""The served models' lifecycle: which models a service holds, loading them within one memory
budget, leases that keep a version alive while requests use it, hot reload across processes, and
the embedding queue. Domain errors only (`rebar.serving.errors`): the HTTP layer maps them."""
