"""The streaming HTTP server: FastAPI routes over `engine.submit`, guarded before any tensor work."""

from inferlab.server.app import create_app
from inferlab.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
