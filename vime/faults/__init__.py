"""Faults a run survives or ends cleanly on: Ctrl-C and SIGTERM, temporary files, forked children
(`stops`), and the restart of a dead rollout engine, on its node or another (`restart`)."""
