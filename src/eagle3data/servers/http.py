"""What every OpenAI-compatible server (SGLang, vLLM, llama.cpp) says over HTTP, read the
same way by both stages: which statuses are worth a retry, the message of an error body in
each server's dialect, and the ``/models`` list."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# Statuses worth retrying later: the request is sent again, nothing is recorded.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class TransientError(Exception):
    """A request failed in a way worth retrying later (connection, timeout, 5xx):
    the prompt is not recorded and will be dispatched again."""


def json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def error_message(payload: Any, text: str) -> str:
    """The message of an error body: OpenAI's, vLLM's and llama.cpp's ``{"error": {"message":
    ...}}``, SGLang's flat ``{"object": "error", "message": ...}``, SGLang's auth failures
    ``{"error": "Unauthorized"}``, FastAPI's ``{"detail": ...}``; else the text itself."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if isinstance(payload.get("detail"), str):
            return payload["detail"]
    return text[:500]


def model_entries(payload: Any) -> list[dict[str, Any]] | None:
    """The entries of a ``/models`` answer, or None when it is not a model list."""
    entries = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(entries, list):
        return None
    return [e for e in entries if isinstance(e, dict)]


def models_entry(payload: Any, model: str) -> Mapping[str, Any]:
    """``model``'s entry in a ``/models`` answer (its only entry when none has that id), or
    an empty mapping."""
    entries = model_entries(payload) or []
    named = [e for e in entries if e.get("id") == model]
    chosen = named or (entries if len(entries) == 1 else [])
    return chosen[0] if chosen else {}


def served_context_length(entry: Mapping[str, Any]) -> int | None:
    """``max_model_len`` of a ``/models`` entry (the context the server serves, which may be
    less than the model's own), or None when it reports none."""
    value = entry.get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
