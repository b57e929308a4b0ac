"""The error a request that breaks a rule raises, naming the field it broke.

Each front door names fields its own way (gRPC's ``max_new_tokens`` is
OpenAI's ``max_tokens``), so the rule's owner (``SamplingParams.validate``,
``SpeculativeEngine.validate``) writes ``{field}`` where the name goes and
each front door fills in its own (``named``), instead of rewriting text.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """``field``: the request field at fault, as ``GenerationRequest`` and ``SamplingParams``
    name it (``prompt_ids`` for the prompt). ``str()`` reads with that name."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.template = message  # "{field}" where the field's name goes
        super().__init__(self.named(field))

    def named(self, name: str) -> str:
        """The message with the field called ``name``."""
        return self.template.replace("{field}", name)
