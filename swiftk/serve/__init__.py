"""``swiftk serve``: an OpenAI-compatible HTTP server over one engine (FastAPI, served by uvicorn).

Optional: ``pip install -e ".[serve]"``. The core package never imports this one. See docs/serve.md.
"""
from .app import Server, serve

__all__ = ["Server", "serve"]
