"""Deployment: freeze a measured configuration into a production document and a systemd service
(`freeze`), install and watch it (`install`, `status`), and export it to SGLang or vLLM (`export`).

The server side of a frozen configuration (the checkpoint hash check at start) lives in
`specserve.server.serve_config` so that the server never imports this package.
"""
