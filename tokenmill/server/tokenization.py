"""POST /tokenize and POST /detokenize (vLLM's shapes): what the server would feed the model for a prompt or a
chat, and the text of token ids. RAG and agent stacks count and budget tokens with them; they run no model."""

from __future__ import annotations

import asyncio

from fastapi.responses import Response
from pydantic import BaseModel

from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest, bad_request
from tokenmill.server.responses import json_response
from tokenmill.server.serving import check_unsupported


class TokenizeMixin:
    """The tokenizer endpoints; mixed into OpenAIServing (chat_prompt_ids comes from ChatMixin)."""

    async def tokenize(self, req: TokenizeRequest) -> Response:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt (a string) or messages (a chat), not both and not neither",
                              "prompt" if req.messages is None else "messages")
        check_unsupported(req)
        if req.prompt is not None:
            if not req.prompt:
                raise bad_request("prompt must not be empty", "prompt")
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            try:
                ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, add_special)
            except Exception as e:  # noqa: BLE001 - the text's failure is this request's alone
                raise bad_request(f"the prompt could not be tokenized: {type(e).__name__}: {e}", "prompt") from None
        else:
            if not req.messages:
                raise bad_request("messages must not be empty", "messages")
            tools = [t.model_dump(exclude_none=True) if isinstance(t, BaseModel) else t for t in req.tools or ()]
            ids = await self.chat_prompt_ids(req.messages, tools or None, req.add_generation_prompt,
                                             req.chat_template_kwargs, req.documents, bool(req.add_special_tokens))
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [self.tokenizer.hf.id_to_token(t) or "" for t in ids]
        return json_response(body)

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        self.check_model(req.model)
        if req.tokens is None:
            raise bad_request("tokens is required", "tokens")
        if not req.tokens:
            raise bad_request("tokens must not be empty", "tokens")
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "tokens")
        # as the prompt was given: special tokens kept (vLLM decodes the same way)
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens, False)
        return json_response({"prompt": text})
