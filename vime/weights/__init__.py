"""The weight sync from the trainer to the rollout engines, with version acknowledgement (`sync`)."""
