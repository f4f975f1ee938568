"""Host KV store: authoritative copies of KV pages in a shared-memory arena, served over gRPC."""
