"""Jupyter iopub messages -> the SDKs' NDJSON output lines.

A ``result`` line carries one key per representation the kernel sent. The SDKs know these names
(``Result`` in ``e2b_code_interpreter/models.py``, ``Result`` in ``@e2b/code-interpreter``); any
other MIME type goes under ``extra``, keyed by the MIME type. ``data`` and ``chart`` come from the
two MIME types our IPython start-up registers (``startup.py``): a DataFrame's table and the chart
data ``e2b_charts`` extracts from a matplotlib figure.
"""

from __future__ import annotations

import re
import time
from typing import Any

#: MIME type -> the SDK's field.
KNOWN_FORMATS: dict[str, str] = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "text/javascript": "javascript",
}
DATA_MIME = "application/vnd.forkyard.data+json"
CHART_MIME = "application/vnd.forkyard.chart+json"
KNOWN_FORMATS[DATA_MIME] = "data"
KNOWN_FORMATS[CHART_MIME] = "chart"


def timestamp_ns() -> int:
    return time.time_ns()


def result_line(bundle: dict[str, Any], *, is_main_result: bool) -> dict[str, Any]:
    line: dict[str, Any] = {"type": "result", "is_main_result": is_main_result}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        field = KNOWN_FORMATS.get(mime)
        if field is None:
            extra[mime] = value
        elif field not in line:  # application/javascript wins over text/javascript
            line[field] = _as_text(value) if field not in ("json", "data", "chart") else value
    if extra:
        line["extra"] = extra
    return line


def _as_text(value: Any) -> Any:
    """Some kernels send a text representation split into a list of lines (nbformat's style)."""
    return "".join(value) if isinstance(value, list) else value


def error_line(content: dict[str, Any]) -> dict[str, Any]:
    traceback = content.get("traceback") or []
    return {
        "type": "error",
        "name": str(content.get("ename", "")),
        "value": str(content.get("evalue", "")),
        "traceback": "\n".join(traceback) if isinstance(traceback, list) else str(traceback),
    }


def reply_error_line(reply: dict[str, Any], stderr: str) -> dict[str, Any]:
    """A failed cell's error from its execute reply (tslab sends no iopub error; its reply has no
    name or value either: they come from the exception it printed on stderr, ``Name: value``)."""
    line = error_line(reply)
    if not line["name"]:
        found = re.search(r"^(\w*(?:Error|Exception)\w*): ?(.*)$", stderr, re.M)
        line["name"], line["value"] = (found.group(1), found.group(2)) if found else ("Error", stderr.strip())
        line["traceback"] = line["traceback"] or stderr
    return line


def stream_line(content: dict[str, Any]) -> dict[str, Any]:
    kind = "stderr" if content.get("name") == "stderr" else "stdout"
    return {"type": kind, "text": str(content.get("text", "")), "timestamp": timestamp_ns()}


def translate(msg: dict[str, Any], *, displays_are_results: bool = False) -> dict[str, Any] | None:
    """One iopub message as an output line, None for messages the SDKs have no line for
    (status, execute_input: their information is sent separately)."""
    kind = msg["header"]["msg_type"]
    content = msg.get("content", {})
    if kind == "stream":
        return stream_line(content)
    if kind == "execute_result":
        return result_line(content.get("data", {}), is_main_result=True)
    if kind == "display_data":
        return result_line(content.get("data", {}), is_main_result=displays_are_results)
    if kind == "error":
        return error_line(content)
    return None
