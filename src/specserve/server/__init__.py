"""OpenAI-compatible HTTP serving: app, schemas, tool-call parsers, metrics, the engine behind them."""
