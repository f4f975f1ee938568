"""The gateway: an OpenAI-compatible HTTP server (FastAPI) in front of the cache guard (gRPC)."""
