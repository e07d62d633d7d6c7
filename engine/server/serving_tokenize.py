"""POST /tokenize (a completion prompt or chat messages) and POST /detokenize.

The chat template and the tokenizer run in a worker thread: a long prompt or a slow template never
stalls the event loop. A request's ``chat_template`` needs --trust-request-chat-template (else 400).
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.server.errors import BadRequestError
from engine.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                    TokenizeCompletionRequest, TokenizeResponse)
from engine.server.serving_chat import render_chat_off_loop
from engine.server.serving_models import OpenAIServingModels


class OpenAIServingTokenization:

    def __init__(self, engine_client: Any, models: OpenAIServingModels,
                 trust_request_chat_template: bool = False) -> None:
        self.engine_client = engine_client
        self.models = models
        self.trust_request_chat_template = trust_request_chat_template
        """--trust-request-chat-template: a request's own ``chat_template`` (text) is rendered, not
        refused."""

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.models.resolve_model_name(req.model)
        tokenizer = self.engine_client.tokenizer
        if isinstance(req, TokenizeChatRequest):
            prompt = await render_chat_off_loop(self.engine_client, req, self.trust_request_chat_template)
            token_ids = prompt.token_ids
        else:
            token_ids = list(await asyncio.to_thread(tokenizer.encode, req.prompt,
                                                     add_special_tokens=req.add_special_tokens))
        token_strs = tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=self.engine_client.max_model_len,
                                tokens=token_ids, token_strs=token_strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve_model_name(req.model)
        vocab_size = len(self.engine_client.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab_size}).",
                                  param="tokens")
        return DetokenizeResponse(prompt=self.engine_client.tokenizer.decode(req.tokens))
