"""Scheduling: which requests run each step and with how many tokens (:mod:`.scheduler`), the step's output
types (:mod:`.output`) and the pure stop checks (:mod:`.stop`)."""
