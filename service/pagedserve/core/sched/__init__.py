"""Scheduling: which requests run each step and with how many tokens (:mod:`.scheduler`), the step's plain output
for the worker (:mod:`.worker_view`), the scheduler's own records (:mod:`.output`), how requests end (:mod:`.stop`:
token checks and stop strings), and the features beside it behind narrow interfaces (:mod:`.policies`): beam groups
(:mod:`.beam_groups`), n > 1 forks (:mod:`.forks`), speculative drafts (:mod:`.drafts`)."""
