"""The errors r3kit raises. Every one is a ``ValueError`` subclass of :class:`R3Error` whose message says what is
wrong, with which numbers, and what to do about it."""

from __future__ import annotations


class R3Error(ValueError):
    """Base class of every r3kit error."""


class MissingRoutedExpertsError(R3Error):
    """A choice has no ``routed_experts`` (the field is null or absent)."""


class MissingTokenIdsError(R3Error):
    """A choice lacks ``token_ids`` / ``prompt_token_ids`` (request with ``return_token_ids: true``)."""


class RowMismatchError(R3Error):
    """The routed-experts rows do not match the tokens (count, layers or top-k)."""


class DenseLayerError(R3Error):
    """Dense (non-MoE) layers are not what the model card says, or would be replayed as experts."""


class MultipleChoicesError(R3Error):
    """A response with several choices (``n > 1`` or several prompts) where one was expected."""


class TruncatedChoiceError(R3Error):
    """A choice that stopped at ``max_tokens`` (``finish_reason: "length"``)."""


class AbortedChoiceError(R3Error):
    """A choice that was aborted (``finish_reason: "abort"``) or never finished."""


class StitchError(R3Error):
    """A turn does not continue the conversation: other tokens, a gap in the rows, other weights."""


class ReplayError(R3Error):
    """Routes cannot be replayed into this model (layers, shapes, ids, an unsupported router)."""
