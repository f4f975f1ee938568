"""The cache guard: renders and tokenizes chat input, tracks session prefixes, forwards to an engine."""
