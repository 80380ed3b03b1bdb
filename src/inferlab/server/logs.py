"""The server's log lines: text for a terminal, or one JSON object per line (`server.log_format=json`) for
a log pipeline; a request's line carries its fields (request_id, status, tokens, timings) as keys."""

from __future__ import annotations

import json
import logging
import logging.config
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "request", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """One stderr handler on the root logger for every logger (uvicorn's included), in the chosen format.

    dictConfig with disable_existing_loggers=False also re-enables the loggers Hydra's own logging set-up
    disabled (every logger created at import time, inferlab.server's request log among them)."""
    formatter = {"()": JsonFormatter} if log_format == "json" else {"format": TEXT_FORMAT}
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"line": formatter},
            "handlers": {
                "stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "line"}
            },
            "root": {"level": level.upper(), "handlers": ["stderr"]},
        }
    )
