"""Benchmarks: the serving sweep client, acceptance evaluation, and comparison reports.

Nothing here imports torch or the engine at module import time, so the serving client runs
against any OpenAI-compatible server from a machine without the model stack.
"""
