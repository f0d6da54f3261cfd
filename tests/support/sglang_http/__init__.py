"""SGLang 0.5.23's own HTTP server with only the model replaced: see harness.py and server.py."""
