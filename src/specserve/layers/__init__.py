"""Model-agnostic building blocks: norms, rotary embeddings, attention, sampling."""
