"""specserve: speculative decoding that pays off."""

__version__ = "0.1.0"
