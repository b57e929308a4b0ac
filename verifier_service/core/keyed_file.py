"""A JSON record kept in a folder under a key: what a start measured (a step-cost calibration,
a chosen form), for later starts under the same key to take at once.

The file is named by the key's digest, ``<prefix>-<sha256 of the key, 20 hex>.json``, and holds
the key beside the record's fields, so a file of another key (a digest collision, a hand-copied
file) is no record. It is written whole, by rename: a start killed mid-write, or two starting
beside each other, never leave half a file that a later start would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class KeyedFile:
    """Where one key's record is kept (the module docstring)."""

    def __init__(self, folder: Path, prefix: str, key: dict) -> None:
        self.key = key
        self.path = folder / f"{prefix}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"

    def read(self) -> dict | None:
        """The record's fields; None when there is no file or it holds another key. An
        unreadable file raises (OSError, ValueError; TypeError for a record that is no JSON
        object, KeyError for one without its key): each caller says in its own words what it
        does instead."""
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        if not isinstance(record, dict):
            raise TypeError(f"the file holds {type(record).__name__}, not a record")
        return record if record["key"] == self.key else None  # a record without its key is unreadable: KeyError

    def write(self, fields: dict) -> None:
        """Keep ``fields`` with the key, whole or not at all; raises OSError where it cannot."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": self.key, **fields}))
        os.replace(partial, self.path)
