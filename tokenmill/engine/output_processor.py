"""Turns scheduler state into RequestOutputs: detokenization, stop strings, logprobs, n > 1.

Stop strings are found here, on text, and the engine ends the request in the scheduler.
While a request runs, the last (longest stop string - 1) characters are held back so a
stream never shows text that a stop string later removes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Child:
    index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""
    num_seen: int = 0  # output tokens already processed
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self.child_to_group: dict[str, tuple[_Group, _Child]] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        group = _Group(request_id, prompt, children[0].prompt_token_ids)
        for i, req in enumerate(children):
            sp = req.sampling_params
            child = _Child(i, req, self.tokenizer.detokenizer(req.prompt_token_ids, sp.skip_special_tokens),
                           logprobs=[] if sp.logprobs is not None else None)
            group.children.append(child)
            self.child_to_group[req.request_id] = (group, child)
        self.groups[request_id] = group

    def child_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [c.request.request_id for c in group.children] if group else []

    def process(self, updated: list[Request], logprobs: dict,
                prompt_logprobs: dict | None = None) -> tuple[list[_Group], list[str]]:
        """Consume new tokens of the given requests (and, once a prompt is done, its prompt logprobs).
        Returns (the groups touched, for ``emit``, and the child ids that a stop string ended, which
        the scheduler must finish)."""
        touched: dict[str, _Group] = {}
        stopped: list[str] = []
        for rid, lps in (prompt_logprobs or {}).items():
            entry = self.child_to_group.get(rid)
            if entry is not None and entry[0].prompt_logprobs is None:  # n > 1: the first child's
                entry[0].prompt_logprobs = lps
        for req in updated:
            entry = self.child_to_group.get(req.request_id)
            if entry is None:
                continue
            group, child = entry
            if child.finish_reason is not None:
                continue
            touched[group.request_id] = group
            if self._consume(child, logprobs.get(req.request_id)):
                if not req.is_finished:
                    stopped.append(req.request_id)
            elif req.is_finished:
                child.finish_reason = req.status.value
                child.stop_reason = req.stop_reason
                child.text += child.detok.flush()
        return list(touched.values()), stopped

    def emit(self, groups: list[_Group]) -> list[RequestOutput]:
        outputs = [self._output(g) for g in groups]
        for g in groups:
            if g.finished:
                self._drop(g)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        if group is None:
            return None
        for c in group.children:
            if c.finish_reason is None:
                c.finish_reason = RequestStatus.FINISHED_ABORTED.value
        self._drop(group)
        return self._output(group)

    def _consume(self, child: _Child, lps) -> bool:
        """Detokenize new tokens; True if a stop string ended the completion."""
        req = child.request
        new = req.output_token_ids[child.num_seen:]
        stops = req.sampling_params.stop
        for j, token in enumerate(new):
            child.num_seen += 1
            delta = child.detok.step(token)
            if child.logprobs is not None and lps:
                sampled_lp, top = lps[j] if j < len(lps) else lps[-1]
                child.logprobs.append({token: sampled_lp, **{t: lp for t, lp in top}})
                child.cumulative_logprob += sampled_lp
            if not stops or not delta:
                child.text += delta
                continue
            # search only where a new match can be: the tail that includes this delta
            tail_from = max(0, len(child.text) - max(len(s) for s in stops) + 1)
            child.text += delta
            hit = _find_stop(child.text, stops, tail_from)
            if hit is not None:
                pos, s = hit
                child.text = child.text[: pos + len(s) if req.sampling_params.include_stop_str_in_output else pos]
                child.finish_reason = RequestStatus.FINISHED_STOPPED.value
                child.stop_reason = s
                return True
        return False

    def _output(self, g: _Group) -> RequestOutput:
        outs = []
        for c in g.children:
            text = c.text
            stops = c.request.sampling_params.stop
            if c.finish_reason is None and stops:
                hold = max(len(s) for s in stops) - 1
                text = text[: max(0, len(text) - hold)] if hold else text
            outs.append(CompletionOutput(
                c.index, text, list(c.request.output_token_ids[: c.num_seen]), c.finish_reason, c.stop_reason,
                list(c.logprobs) if c.logprobs is not None else None,
                c.cumulative_logprob if c.logprobs is not None else None,
            ))
        metrics = [_metrics(c.request) for c in g.children]
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, g.finished, metrics,
                             g.prompt_logprobs, max(g.children[0].request.num_cached_tokens, 0),
                             g.children[0].request.pooled)

    def _drop(self, g: _Group) -> None:
        self.groups.pop(g.request_id, None)
        for c in g.children:
            self.child_to_group.pop(c.request.request_id, None)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _metrics(req: Request) -> RequestMetrics:
    t = req.timings
    return RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.finished, list(t.token_times),
                          req.num_preemptions)
