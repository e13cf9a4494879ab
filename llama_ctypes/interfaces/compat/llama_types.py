"""The TypedDicts llama-cpp-python names its request and response shapes with (OpenAI's shapes).

They describe the dicts :class:`~.llama.Llama` takes and returns; ``total=False`` where a key may be
absent. Names and aliases follow ``llama_cpp.llama_types`` so that annotations and imports keep working.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, TypedDict, Union

__all__ = [
    "JsonType",
    "EmbeddingUsage",
    "Embedding",
    "CreateEmbeddingResponse",
    "CompletionLogprobs",
    "CompletionChoice",
    "CompletionUsage",
    "CreateCompletionResponse",
    "ChatCompletionResponseFunctionCall",
    "ChatCompletionMessageToolCallFunction",
    "ChatCompletionMessageToolCall",
    "ChatCompletionMessageToolCalls",
    "ChatCompletionResponseMessage",
    "ChatCompletionFunction",
    "ChatCompletionTopLogprobToken",
    "ChatCompletionLogprobToken",
    "ChatCompletionLogprobs",
    "ChatCompletionResponseChoice",
    "CreateChatCompletionResponse",
    "ChatCompletionMessageToolCallChunkFunction",
    "ChatCompletionMessageToolCallChunk",
    "ChatCompletionStreamResponseDeltaEmpty",
    "ChatCompletionStreamResponseDeltaFunctionCall",
    "ChatCompletionStreamResponseDelta",
    "ChatCompletionStreamResponseChoice",
    "CreateChatCompletionStreamResponse",
    "ChatCompletionFunctions",
    "ChatCompletionFunctionCallOption",
    "ChatCompletionRequestResponseFormat",
    "ChatCompletionRequestMessageContentPartText",
    "ChatCompletionRequestMessageContentPartImageImageUrl",
    "ChatCompletionRequestMessageContentPartImage",
    "ChatCompletionRequestMessageContentPart",
    "ChatCompletionRequestSystemMessage",
    "ChatCompletionRequestUserMessage",
    "ChatCompletionRequestAssistantMessageFunctionCall",
    "ChatCompletionRequestAssistantMessage",
    "ChatCompletionRequestToolMessage",
    "ChatCompletionRequestFunctionMessage",
    "ChatCompletionRequestMessage",
    "ChatCompletionRequestFunctionCallOption",
    "ChatCompletionRequestFunctionCall",
    "ChatCompletionFunctionParameters",
    "ChatCompletionToolFunction",
    "ChatCompletionTool",
    "ChatCompletionNamedToolChoiceFunction",
    "ChatCompletionNamedToolChoice",
    "ChatCompletionToolChoiceOption",
    "EmbeddingData",
    "CompletionChunk",
    "Completion",
    "CreateCompletionStreamResponse",
    "ChatCompletionMessage",
    "ChatCompletionChoice",
    "ChatCompletion",
    "ChatCompletionChunkDeltaEmpty",
    "ChatCompletionChunkChoice",
    "ChatCompletionChunkDelta",
    "ChatCompletionChunk",
    "ChatCompletionStreamResponse",
    "ChatCompletionResponseFunction",
    "ChatCompletionFunctionCall",
]

JsonType = Union[None, int, str, bool, List[Any], Dict[str, Any]]


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class Embedding(TypedDict):
    index: int
    object: str
    embedding: Union[List[float], List[List[float]]]


class CreateEmbeddingResponse(TypedDict):
    object: Literal["list"]
    model: str
    data: List[Embedding]
    usage: EmbeddingUsage


class CompletionLogprobs(TypedDict):
    text_offset: List[int]
    token_logprobs: List[Optional[float]]
    tokens: List[str]
    top_logprobs: List[Optional[Dict[str, float]]]


class CompletionChoice(TypedDict):
    text: str
    index: int
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[Literal["stop", "length"]]


class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CreateCompletionResponse(TypedDict, total=False):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: CompletionUsage


class ChatCompletionResponseFunctionCall(TypedDict):
    name: str
    arguments: str


class ChatCompletionMessageToolCallFunction(TypedDict):
    name: str
    arguments: str


class ChatCompletionMessageToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ChatCompletionMessageToolCallFunction


ChatCompletionMessageToolCalls = List[ChatCompletionMessageToolCall]


class ChatCompletionResponseMessage(TypedDict, total=False):
    content: Optional[str]
    tool_calls: ChatCompletionMessageToolCalls
    role: Literal["assistant", "function"]
    function_call: ChatCompletionResponseFunctionCall
    reasoning_content: str


class ChatCompletionFunction(TypedDict, total=False):
    name: str
    description: str
    parameters: Dict[str, JsonType]


class ChatCompletionTopLogprobToken(TypedDict):
    token: str
    logprob: float
    bytes: Optional[List[int]]


class ChatCompletionLogprobToken(ChatCompletionTopLogprobToken):
    top_logprobs: List[ChatCompletionTopLogprobToken]


class ChatCompletionLogprobs(TypedDict):
    content: Optional[List[ChatCompletionLogprobToken]]
    refusal: Optional[List[ChatCompletionLogprobToken]]


class ChatCompletionResponseChoice(TypedDict, total=False):
    index: int
    message: ChatCompletionResponseMessage
    logprobs: Optional[ChatCompletionLogprobs]
    finish_reason: Optional[str]


class CreateChatCompletionResponse(TypedDict, total=False):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: List[ChatCompletionResponseChoice]
    usage: CompletionUsage


class ChatCompletionMessageToolCallChunkFunction(TypedDict, total=False):
    name: Optional[str]
    arguments: str


class ChatCompletionMessageToolCallChunk(TypedDict, total=False):
    index: int
    id: str
    type: Literal["function"]
    function: ChatCompletionMessageToolCallChunkFunction


class ChatCompletionStreamResponseDeltaEmpty(TypedDict):
    pass


class ChatCompletionStreamResponseDeltaFunctionCall(TypedDict):
    name: str
    arguments: str


class ChatCompletionStreamResponseDelta(TypedDict, total=False):
    content: Optional[str]
    function_call: ChatCompletionStreamResponseDeltaFunctionCall
    tool_calls: List[ChatCompletionMessageToolCallChunk]
    role: Optional[Literal["system", "user", "assistant", "tool"]]
    reasoning_content: str


class ChatCompletionStreamResponseChoice(TypedDict, total=False):
    index: int
    delta: Union[ChatCompletionStreamResponseDelta, ChatCompletionStreamResponseDeltaEmpty]
    finish_reason: Optional[str]
    logprobs: Optional[ChatCompletionLogprobs]


class CreateChatCompletionStreamResponse(TypedDict, total=False):
    id: str
    model: str
    object: Literal["chat.completion.chunk"]
    created: int
    choices: List[ChatCompletionStreamResponseChoice]


class ChatCompletionFunctions(TypedDict, total=False):
    name: str
    description: str
    parameters: Dict[str, JsonType]


class ChatCompletionFunctionCallOption(TypedDict):
    name: str


class ChatCompletionRequestResponseFormat(TypedDict, total=False):
    type: Literal["text", "json_object", "json_schema"]
    schema: JsonType
    json_schema: Dict[str, JsonType]


class ChatCompletionRequestMessageContentPartText(TypedDict):
    type: Literal["text"]
    text: str


class ChatCompletionRequestMessageContentPartImageImageUrl(TypedDict, total=False):
    url: str
    detail: Literal["auto", "low", "high"]


class ChatCompletionRequestMessageContentPartImage(TypedDict):
    type: Literal["image_url"]
    image_url: Union[str, ChatCompletionRequestMessageContentPartImageImageUrl]


ChatCompletionRequestMessageContentPart = Union[ChatCompletionRequestMessageContentPartText,
                                                ChatCompletionRequestMessageContentPartImage]


class ChatCompletionRequestSystemMessage(TypedDict):
    role: Literal["system"]
    content: Optional[str]


class ChatCompletionRequestUserMessage(TypedDict):
    role: Literal["user"]
    content: Optional[Union[str, List[ChatCompletionRequestMessageContentPart]]]


class ChatCompletionRequestAssistantMessageFunctionCall(TypedDict):
    name: str
    arguments: str


class ChatCompletionRequestAssistantMessage(TypedDict, total=False):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: ChatCompletionMessageToolCalls
    function_call: ChatCompletionRequestAssistantMessageFunctionCall


class ChatCompletionRequestToolMessage(TypedDict):
    role: Literal["tool"]
    content: Optional[str]
    tool_call_id: str


class ChatCompletionRequestFunctionMessage(TypedDict):
    role: Literal["function"]
    content: Optional[str]
    name: str


ChatCompletionRequestMessage = Union[ChatCompletionRequestSystemMessage, ChatCompletionRequestUserMessage,
                                     ChatCompletionRequestAssistantMessage, ChatCompletionRequestToolMessage,
                                     ChatCompletionRequestFunctionMessage]


class ChatCompletionRequestFunctionCallOption(TypedDict):
    name: str


ChatCompletionRequestFunctionCall = Union[Literal["none", "auto"], ChatCompletionRequestFunctionCallOption]
ChatCompletionFunctionParameters = Dict[str, JsonType]


class ChatCompletionToolFunction(TypedDict, total=False):
    name: str
    description: str
    parameters: ChatCompletionFunctionParameters


class ChatCompletionTool(TypedDict):
    type: Literal["function"]
    function: ChatCompletionToolFunction


class ChatCompletionNamedToolChoiceFunction(TypedDict):
    name: str


class ChatCompletionNamedToolChoice(TypedDict):
    type: Literal["function"]
    function: ChatCompletionNamedToolChoiceFunction


ChatCompletionToolChoiceOption = Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoice]

# The older names llama-cpp-python keeps as aliases.
EmbeddingData = Embedding
CompletionChunk = CreateCompletionResponse
Completion = CreateCompletionResponse
CreateCompletionStreamResponse = CreateCompletionResponse
ChatCompletionMessage = ChatCompletionResponseMessage
ChatCompletionChoice = ChatCompletionResponseChoice
ChatCompletion = CreateChatCompletionResponse
ChatCompletionChunkDeltaEmpty = ChatCompletionStreamResponseDeltaEmpty
ChatCompletionChunkChoice = ChatCompletionStreamResponseChoice
ChatCompletionChunkDelta = ChatCompletionStreamResponseDelta
ChatCompletionChunk = CreateChatCompletionStreamResponse
ChatCompletionStreamResponse = CreateChatCompletionStreamResponse
ChatCompletionResponseFunction = ChatCompletionFunction
ChatCompletionFunctionCall = ChatCompletionResponseFunctionCall
