"""The OpenAI-compatible server: requests parsed (protocol), the engine stepped by one thread (engine_loop),
responses built (responses), metrics (metrics), routes and uvicorn (api_server)."""
from .api_server import ServerConfig, build_app, serve
from .engine_loop import EngineClient

__all__ = ["EngineClient", "ServerConfig", "build_app", "serve"]
