"""The RL step: the driver (the synchronous loop and the run around it), the bounded-staleness
asynchronous loop, the weight-version timeline, and the rollout/trainer parity check."""
