"""KV-cache storage and bookkeeping."""
