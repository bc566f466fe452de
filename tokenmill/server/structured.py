"""A request's structured-output constraint, from whichever spelling the client used: OpenAI's
``response_format``, vLLM's ``structured_outputs`` object or its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. At most one may be given."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.protocol import bad_request

if TYPE_CHECKING:
    from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest


def structured_outputs(req: CompletionRequest | ChatCompletionRequest
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field it came from, for error messages)."""
    given = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", dict(json_object=True)))
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            given.append(("response_format", dict(json=rf.json_schema.json_schema)))
    so = req.structured_outputs
    if so is not None:
        fields = {k: v for k, v in (("json", so.json_schema), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar)) if v is not None}
        if so.json_object:
            fields["json_object"] = True
        given.append(("structured_outputs", fields))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            given.append((name, {key: value}))
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"give one structured-output constraint, not {', '.join(n for n, _ in given)}",
                          given[1][0])
    param, fields = given[0]
    try:
        return StructuredOutputsParams(**fields), param
    except ValueError as e:
        raise bad_request(str(e), param) from None
