"""Serving the bundled engine: the OpenAI-compatible HTTP server (:mod:`.server`), its
request bodies and body limit, the asyncio face of the step loop (:mod:`.async_engine`)
and ``/metrics`` (:mod:`.metrics`). Knows nothing of kvpool: the elastic server
(:mod:`kvpool.elastic_server`) builds on it."""
