"""Anthropic's Messages API (``POST /v1/messages``) over the OpenAI chat-completions serving.

One concept per module, imported by full path (this package module imports nothing):

- ``protocol``: the request and response bodies (pydantic), Anthropic's shapes;
- ``translate``: a Messages request -> the chat-completion request dict the server takes, and a chat
  completion -> a ``Message``;
- ``stream``: our chat-completion chunks -> Anthropic's SSE event sequence;
- ``errors``: Anthropic's error body, mapped from the HTTP status;
- ``serving``: ``AnthropicMessages``, the route handler over a chat-completion backend callable.
"""
