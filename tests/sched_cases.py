"""Driving the real scheduler without a model: its plain SchedulerOutput read back as entries of the scheduler's
own requests, and a stand-in worker's ModelRunnerOutput (every sampling request gets a fixed token)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.outputs import ModelRunnerOutput
from pagedserve.request import Request
from pagedserve.scheduler_output import SchedulerOutput


@dataclass
class Entry:
    request: Request
    num_new_tokens: int
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class Step:
    output: SchedulerOutput
    scheduled: list[Entry]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return self.output.num_batched_tokens


def schedule(s) -> Step:
    """``s.schedule()``, its scheduled ids resolved to the scheduler's requests (before the step ran)."""
    out = s.schedule()
    entries = []
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        entries.append(Entry(r, n, r.num_computed_tokens + n - len(drafts) == r.num_tokens, list(drafts)))
    return Step(out, entries, [s.requests[rid] for rid in out.preempted_req_ids if rid in s.requests])


def worker_output(step: Step, token: int = 5) -> ModelRunnerOutput:
    """What a worker would return if every sampling request sampled ``token`` (drafts all rejected)."""
    sampled = [e for e in step.scheduled if e.samples]
    return ModelRunnerOutput(req_ids=[e.request.seq_id for e in sampled], sampled_token_ids=[[token] for _ in sampled],
                             logprobs=[[None] for _ in sampled], num_accepted=[0] * len(sampled))
