"""A long-context evaluation through the real stack over HTTP (issue 25): RULER-style tasks over varied
real-text haystacks made without downloads, needle templates and question phrasings from pools split into
a tuning and a held-out set, every request shape a user sends, and a depth x length grid with Wilson 95%
intervals for dense / ring sparse / ring retrieval-off / exact / shard. `python -m bench.longeval.run -h`."""
