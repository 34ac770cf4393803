"""Beam-search requests in the server: each prompt's ``BeamSearch`` steps once per scheduler turn.

A beam search holds its own KV cache of ``num_beams`` rows (its beams fork and reorder rows
every step, which the shared continuous batch cannot do for one request without disturbing
the others), so it runs beside the batch: the scheduler starts a job when its rows fit under
``--max-batch`` beam rows in total and steps every running job once per turn, after the batch's
decode step. Beam search has nothing to stream before it ends: when every prompt's search is
done, its best ``n`` hypotheses become the request's choices (text, token count, finish reason).
"""

from __future__ import annotations

from llmx.runtime.batch import Event
from llmx.runtime.beam import BeamParams, BeamSearch


class BeamJob:
    def __init__(self, ticket, params: list[BeamParams], n: int):
        self.ticket, self.params, self.n = ticket, params, n  # one BeamParams per prompt
        self.searches: list[BeamSearch] = []

    @property
    def rows(self) -> int:
        return sum(p.num_beams for p in self.params)

    def step(self, backend, end_ids: list[int]) -> list[Event]:
        """One token for every beam of every prompt; the choices' events once all are done."""
        if not self.searches:
            prompts = [self.ticket.seqs[i * self.n].prompt_ids for i in range(len(self.params))]
            self.searches = [BeamSearch(backend, p, params, end_ids) for p, params in zip(prompts, self.params)]
        for search in self.searches:
            search.step()
        if not all(s.done for s in self.searches):
            return []
        return [event for i, search in enumerate(self.searches) for event in self._choices(i, search)]

    def _choices(self, prompt: int, search: BeamSearch) -> list[Event]:
        events = []
        for j, hypothesis in enumerate(search.results()[: self.n]):
            seq = self.ticket.seqs[prompt * self.n + j]
            text = "".join(seq.accept(t) for t in hypothesis.token_ids if not seq.finished)
            if not seq.finished:
                seq.finish_reason = hypothesis.finish_reason
            events.append((seq, text))
        return events
