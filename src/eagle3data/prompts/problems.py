"""What can be wrong with one record: the exceptions the record shapes raise."""

from __future__ import annotations


class Bad(Exception):
    """A record that cannot become a conversation; the message starts with the field."""

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"{field_path}: {problem}")


class UnreadableImage(Bad):
    """A record naming an image that cannot be read (missing, corrupt, a malformed data
    URI): the record is skipped and recorded whatever ``on_invalid`` says, as the rest of
    the dataset is usable."""
