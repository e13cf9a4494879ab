"""OpenAI's shapes, in one home: :mod:`.shapes` builds them (a leaf every path uses: chat, tool calls,
the HTTP routes); :mod:`.chat` is the Python API's ``chat_completion``/``stream_chat_completion``."""

from .shapes import (
    FINISH_REASONS,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    CompletionUsage,
    Envelope,
    PromptTokensDetails,
    finish_reason,
    input_usage,
    new_call_id,
    new_id,
    usage,
)

__all__ = ["ChatCompletion", "ChatCompletionChoice", "ChatCompletionChunk", "ChatCompletionMessage",
           "CompletionUsage", "PromptTokensDetails", "Envelope", "FINISH_REASONS", "finish_reason", "usage",
           "input_usage", "new_id", "new_call_id"]
