"""The HTTP front of a server: the FastAPI app (`app.build_app`), its `/generate`
(`native`) and OpenAI-compatible (`openai`) routes, request models (`models`), the
`{"error": ...}` body and exception mapping (`errors`), streaming responses that clean
up however they end (`streaming`), the API-key middleware (`auth`), chat templates and
Prometheus metrics.

Nothing is re-exported here: `serving.http.errors`, `serving.http.streaming` and
`serving.http.auth` are imported by the router too, and must not pull in the app.
"""
